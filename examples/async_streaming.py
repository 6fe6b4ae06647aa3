"""Async use of specserve's offline API: stream tokens with AsyncLLM, or await LLM.agenerate.

The how-to that made up `speculative_sampling=True` (docs seed 002) awaited
`llm.agenerate(...)`; that method exists here (vLLM has none): it runs
`generate` off the event loop.  For token-by-token streaming use AsyncLLM.

    python examples/async_streaming.py
"""

import asyncio

from specserve import AsyncLLM, SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 4}


async def main() -> None:
    params = SamplingParams(temperature=0.7, max_tokens=50)
    async with AsyncLLM(model="embedded:smollm2-135m-instruct", speculative_config=SPEC) as llm:
        final = None
        async for out in llm.chat([{"role": "user", "content": "What is speculative decoding?"}], params):
            print(out.outputs[0].new_text, end="", flush=True)
            final = out
        print(f"\n[{final.outputs[0].finish_reason}; mean acceptance length {final.mean_acceptance_length:.2f}]")
        # many prompts at once, batched by the engine; final outputs in prompt order
        outs = await llm.agenerate(["The capital of France is", "1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=16))
        for o in outs:
            print(repr(o.prompt), "->", repr(o.outputs[0].text))


asyncio.run(main())
