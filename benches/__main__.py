"""python -m benches NAME [OPTIONS]: run one benchmark (`pdm run bench-NAME` is this command).

Ctrl-C, SIGTERM and an MLX that cannot load are set up here, before the benchmark's module
loads MLX; then its main(argv) runs. A run the benchmark starts in a fresh process comes back
in here too (`NAME --child-spec FILE`, see harness/runs.py).
"""

import importlib
import os
import sys

from tiny_llm_support import startup

BENCHMARKS = (
    "chunked-prefill", "few-row", "flash-attention", "long-context", "model", "moe", "own-kernel",
    "paged-decode", "prefix-cache",
    "quantization", "ragged-step", "serving", "serving-overhead", "shape-stable", "speculative",
    "structured-output", "tensor-parallel", "token-delivery",
)  # fmt: skip


def main() -> int:
    name = sys.argv[1] if len(sys.argv) > 1 else None
    if name not in BENCHMARKS:
        print("usage: python -m benches NAME [OPTIONS]  (NAME --help for its options)\n"
              f"NAME is one of: {', '.join(BENCHMARKS)}", file=sys.stderr)  # fmt: skip
        return 2
    sys.argv = [f"bench-{name}", *sys.argv[2:]]  # the name argparse's messages start with
    startup.start()
    from tiny_llm_support import reexec_with_openblas  # loads MLX: after start()

    module = importlib.import_module(f"benches.{name.replace('-', '_')}")
    run = sys.argv[1:2] == ["--child-spec"]  # a run of the plan, in the BLAS its parent chose
    if run and hasattr(module, "measure"):
        from benches.harness import child_main

        return startup.run(lambda: child_main(module, sys.argv[2]))
    if getattr(module, "NO_OPENBLAS", False):  # a tiny model: its runs and servers need none
        os.environ.setdefault("TINY_LLM_NO_OPENBLAS", "1")
    elif not run and "--no-openblas" not in sys.argv:
        reexec_with_openblas()  # Linux: Debian's OpenBLAS where installed; the runs inherit it
    return startup.run(lambda: module.main(sys.argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
