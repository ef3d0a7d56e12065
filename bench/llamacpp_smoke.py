"""Checks a llama-cpp-python build on this CPU: a multi-token prompt decodes without crashing.

    LLAMA_VENV/bin/python bench/llamacpp_smoke.py MODEL.gguf

Some builds crash in multi-token (batched) decode on some CPUs (seen: GGML_NATIVE=ON on a Xeon
with AMX); `make bench-llamacpp` runs this right after building so a bad build fails there, not
in the middle of a benchmark. Needs only llama_cpp (the llama.cpp venv has no eagleserve).
"""

from __future__ import annotations

import sys

import llama_cpp


def main() -> None:
    llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=512, n_batch=64, verbose=False)
    prompt = llm.tokenize(b"The quick brown fox jumps over the lazy dog. " * 8)
    out = []
    for tok in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        out.append(int(tok))
        if len(out) == 16:
            break
    assert len(out) == 16, out
    print(f"llama.cpp {llama_cpp.__version__}: {len(prompt)}-token prompt, 16 tokens decoded")


if __name__ == "__main__":
    main()
