"""vLLM's "Draft Models" offline example (docs seed 000), run on specserve.

Only the model names differ from the vLLM page: the target is the embedded
SmolLM2-135M-Instruct and the draft is the same small model (self-drafting: its
drafts are accepted almost always, the acceptance-length sanity check).  Pass
"ngram" to draft by prompt lookup instead (no draft model; "model" is then unused).

    python examples/offline_inference.py            # "method": "draft_model"
    python examples/offline_inference.py ngram      # "method": "ngram"
"""

import sys

from specserve import LLM, SamplingParams

METHOD = sys.argv[1] if len(sys.argv) > 1 else "draft_model"

# ---- the seed's code, model names replaced ----
prompts = ["The future of AI is"]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)

llm = LLM(
    model="embedded:smollm2-135m-instruct",
    tensor_parallel_size=1,
    speculative_config={
        "model": "embedded:smollm2-135m-instruct",
        "num_speculative_tokens": 5,
        "method": METHOD,
    },
)
outputs = llm.generate(prompts, sampling_params)

for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
# ---- end of the seed's code ----

for output in outputs:  # specserve extra: the request's speculative-decoding figures
    print(f"  {METHOD}: {output.num_drafts} drafts, {output.num_accepted_tokens} accepted tokens, "
          f"mean acceptance length {output.mean_acceptance_length:.2f}")
