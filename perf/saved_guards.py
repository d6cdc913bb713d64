"""What evaluating the saved traces' guards costs a decode step: batch-1 decode of the default
model (or --model), one engine and one request, its steps taken in turn with the guards
evaluated at every call (as they were) and once per call signature (executor/precompiled.py).

    .venv/bin/python perf/saved_guards.py
    .venv/bin/python perf/saved_guards.py --rounds 5 --output-len 300
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from compiled_engine.config import EngineConfig
from compiled_engine.engine.llm_engine import LLMEngine
from compiled_engine.engine.sampling_params import SamplingParams
from compiled_engine.executor import precompiled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=200)
    args = parser.parse_args()

    every_call = False
    remembering = precompiled.PrecompiledFunction.__call__

    def forgetting(self: precompiled.PrecompiledFunction, *call_args: Any) -> Any:
        if every_call:
            self._checked.clear()
        return remembering(self, *call_args)

    precompiled.PrecompiledFunction.__call__ = forgetting  # type: ignore[method-assign]
    engine = LLMEngine(EngineConfig(model=args.model, enable_prefix_caching=False))
    prompt = [100 + i % 1000 for i in range(args.prompt_len)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.rounds):
        engine.add_request(prompt, params)
        engine.step()  # the prefill
        while engine.has_unfinished_requests():
            every_call = not every_call
            started = time.perf_counter()
            engine.step()
            times[every_call].append(time.perf_counter() - started)
    before, now = (statistics.median(times[flag]) * 1000 for flag in (True, False))
    print(f"guards at every call:     {before:.2f} ms a step ({1000 / before:.1f} tokens/s)")
    print(f"once per call signature:  {now:.2f} ms a step ({1000 / now:.1f} tokens/s), {before / now:.3f}x")


if __name__ == "__main__":
    main()
