"""llama.cpp as a same-run baseline (`bench latency --baseline llama-cpp`): llama-cpp-python on the
very GGUF file the engine runs, with the same prompt tokens and the same thread count.

llama-cpp-python is an optional extra (`pip install 'compiled_engine[llama-cpp]'`, which builds
llama.cpp from source). Its prefill is one `eval` of the whole prompt (in batches of
`n_batch` tokens); its decode is one `eval` of one token per step, greedy, from the logits of the
step before, as our engine's batch-1 decode is.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from compiled_engine.bench.hf_baseline import BaselineUnavailable


def load_llama_cpp(gguf: Path | None, context: int, logits_all: bool = False) -> Any:
    """A llama.cpp context on `gguf` holding `context` tokens, on torch's thread count; with
    `logits_all`, keeping the logits of every token it evaluates (`scores`)."""
    if gguf is None:
        raise BaselineUnavailable("the llama-cpp baseline needs a GGUF model (the default model, or --model file.gguf)")
    try:
        from llama_cpp import Llama
    except ImportError as exc:
        raise BaselineUnavailable(
            "the llama-cpp baseline needs llama-cpp-python: pip install 'compiled_engine[llama-cpp]' "
            "(it builds llama.cpp from source, about ten minutes on two cores)"
        ) from exc
    threads = torch.get_num_threads()
    return Llama(
        model_path=str(gguf),
        n_ctx=context,
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        logits_all=logits_all,
        verbose=False,
    )


def llama_cpp_prefill_seconds(llm: Any, prompt: list[int]) -> float:
    """Seconds for one prefill of `prompt` from an empty context."""
    llm.reset()
    started = time.perf_counter()
    llm.eval(prompt)
    return time.perf_counter() - started


def llama_cpp_decode_seconds(llm: Any, prompt: list[int], new_tokens: int) -> float:
    """Seconds per decode step: `new_tokens` greedy steps after a prefill of `prompt` (the prefill
    is not counted)."""
    import llama_cpp
    import numpy as np

    vocab = llm.n_vocab()
    llm.reset()
    llm.eval(prompt)
    started = time.perf_counter()
    for _ in range(new_tokens):
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))
        llm.eval([int(np.argmax(logits))])
    return (time.perf_counter() - started) / new_tokens
