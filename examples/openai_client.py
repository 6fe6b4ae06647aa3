"""vLLM's OpenAI client code (docs seed 000), unchanged, against `specserve serve`.

Start the server with the seed's command line, model names replaced:

    specserve serve embedded:smollm2-135m-instruct \
        --host 0.0.0.0 \
        --port 8000 \
        --seed 42 \
        -tp 1 \
        --max_model_len 2048 \
        --gpu_memory_utilization 0.8 \
        --speculative_config '{"model": "embedded:smollm2-135m-instruct", "num_speculative_tokens": 5, "method": "draft_model"}'

(`--dry-run` prints the Hydra command line this becomes.)  Then:

    python examples/openai_client.py                              # http://localhost:8000/v1
    python examples/openai_client.py http://my-host:9000/v1       # or OPENAI_BASE_URL=...

The response carries specserve's `spec_decode` figures next to the OpenAI fields.
"""

import os
import sys

from openai import OpenAI

# Modify OpenAI's API key and API base to use vLLM's API server (here: the first argument,
# else $OPENAI_BASE_URL, else the seed's localhost:8000).
openai_api_key = "EMPTY"
openai_api_base = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OPENAI_BASE_URL", "http://localhost:8000/v1")

client = OpenAI(
    # defaults to os.environ.get("OPENAI_API_KEY")
    api_key=openai_api_key,
    base_url=openai_api_base,
)

models = client.models.list()
model = models.data[0].id

# Completion API
stream = False
completion = client.completions.create(
    model=model,
    prompt="The future of AI is",
    echo=False,
    n=1,
    stream=stream,
)

print("Completion results:")
if stream:
    for c in completion:
        print(c)
else:
    print(completion)
