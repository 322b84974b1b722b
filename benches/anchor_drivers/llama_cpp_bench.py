"""Run by llama-cpp's own Python (benches/model_anchors.py): one stream through llama.cpp, timed.
Reads a JSON spec on stdin (model: a GGUF file, prompt, decode_tokens, warmup, threads, n_ctx),
prefills the prompt in one call, then decodes warmup + decode_tokens greedy tokens one call each,
and prints ANCHOR_RESULT and JSON: prefill seconds, the timed steps' seconds, the first tokens,
the GGUF's weight bytes.
"""

import json
import sys
import time

import gguf
import llama_cpp
import numpy as np


def next_token(llm: llama_cpp.Llama) -> int:
    """The argmax of the last position's logits (microseconds against a step's milliseconds)."""
    logits = llm._ctx.get_logits_ith(-1)  # [vocab]
    return int(np.ctypeslib.as_array(logits, shape=(llm.n_vocab(),)).argmax())


def main() -> int:
    spec = json.load(sys.stdin)
    prompt, threads = spec["prompt"], spec["threads"]
    llm = llama_cpp.Llama(model_path=spec["model"], n_ctx=spec["n_ctx"], n_batch=512,
                          n_threads=threads, n_threads_batch=threads, verbose=False)  # fmt: skip
    llm.eval(prompt[:32])  # warm-up: the thread pool and the weights' first touch
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)  # in batches of 512 tokens (n_batch, llama.cpp's default)
    prefill_s = time.perf_counter() - t0
    tokens, steps = [next_token(llm)], []
    for _ in range(spec["warmup"] + spec["decode_tokens"]):
        t0 = time.perf_counter()
        llm.eval(tokens[-1:])
        tokens.append(next_token(llm))
        steps.append(time.perf_counter() - t0)
    reader = gguf.GGUFReader(spec["model"])
    out = {"prefill_s": prefill_s, "step_s": steps[spec["warmup"] :], "tokens": tokens[:16],
           "weight_bytes": int(sum(t.n_bytes for t in reader.tensors)),
           "version": llama_cpp.__version__,
           "system_info": llama_cpp.llama_print_system_info().decode().strip()}  # fmt: skip
    print("ANCHOR_RESULT " + json.dumps(out), flush=True)  # the line model_anchors.py reads
    return 0


if __name__ == "__main__":
    sys.exit(main())
