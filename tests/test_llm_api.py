"""The vLLM-shaped offline API (issue #9): ``specserve.LLM`` / ``AsyncLLM`` / ``SamplingParams``.

On tiny random llamas (float32): the seed's offline example runs as written
(model names replaced) with a draft model and with n-gram; every prompt form;
greedy output equals ``specserve-generate`` and the OpenAI server on the same
config, and speculative output equals plain output; AsyncLLM streams; every
made-up or removed knob fails in one line saying what to use instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import re
import subprocess
import sys

import openai
import pytest

import specserve
from specserve import AsyncLLM, LLM, SamplingParams
from specserve.cli import UsageError, compose_config, generate_main
from specserve.compat import UnsupportedArgumentError, hydra_value
from specserve.config import ServerConfig
from specserve.errors import ConfigError, InvalidRequestError

pytestmark = pytest.mark.timeout(120)

PROMPTS = ["w10 w11 w12 w10 w11 w12 w10", "w7 w8 w9 w7 w8", "w30 w31 w30 w31 w30 w31"]
CHAT = [{"role": "system", "content": "w3 w4"}, {"role": "user", "content": "w20 w21 w20 w21"}]
N = 12
# A small KV cache for tiny models; K drafts every step (the tests compare draft counts).
SMALL = dict(dtype="float32", num_kv_blocks=128, block_size=4, speculation="fixed")


def greedy(max_tokens: int = N, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def texts(outs) -> list[str]:
    return [o.outputs[0].text for o in outs]


@pytest.fixture(scope="module")
def plain(tiny_llama):
    return LLM(model=str(tiny_llama), **SMALL)


@pytest.fixture(scope="module")
def drafted(tiny_llama, tiny_draft):
    spec = {"model": str(tiny_draft), "num_speculative_tokens": 3, "method": "draft_model"}
    return LLM(model=str(tiny_llama), speculative_config=spec, **SMALL)


@pytest.fixture(scope="module")
def ngram(tiny_llama):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    return LLM(model=str(tiny_llama), speculative_config=spec, **SMALL)


# --------------------------------------------------------------------------- the seeds' code

SEED_OFFLINE = '''
from specserve import LLM, SamplingParams

prompts = ["The future of AI is"]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)

llm = LLM(
    model=TARGET,
    tensor_parallel_size=1,
    speculative_config={
        "model": DRAFT,
        "num_speculative_tokens": 5,
        "method": METHOD,
    },
)
outputs = llm.generate(prompts, sampling_params)

for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
'''


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_seed_offline_example_runs_as_written(tiny_llama, tiny_draft, method):
    code = (SEED_OFFLINE.replace("TARGET", repr(str(tiny_llama))).replace("DRAFT", repr(str(tiny_draft)))
            .replace("METHOD", repr(method)))  # fmt: skip
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "seed_000_offline.py", "exec"), {})
    line = out.getvalue().strip()
    assert re.fullmatch(r"Prompt: 'The future of AI is', Generated text: '.+'", line), line


SEED_HOWTO = '''
from specserve import LLM, SamplingParams
sampling_params = SamplingParams(
    temperature=0.7,
    max_tokens=50,
    speculative_sampling=True,
    speculative_model="meta-llama/Llama-3.1-4B-Instruct",  # smaller model for speculation
    speculative_ratio=4  # number of tokens speculative model generates per main model token
)
'''


def test_seed_howto_code_fails_in_one_line_naming_the_fix():
    with pytest.raises(TypeError) as e:
        exec(SEED_HOWTO, {})
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("SamplingParams(speculative_sampling=...)")
    assert 'speculative_config={"method": "draft_model", "model": <draft>, "num_speculative_tokens": N}' in msg


# --------------------------------------------------------------------------- made-up and removed knobs


@pytest.mark.parametrize("knob, value, hint", [
    ("speculative_sampling", True, "speculative decoding is set on the engine"),
    ("speculative_model", "x", '"model"'),
    ("speculative_ratio", 4, '"num_speculative_tokens"'),
    ("num_speculative_tokens", 4, '"num_speculative_tokens"'),
    ("speculative_config", {"method": "ngram"}, "speculative decoding is set on the engine"),
])  # fmt: skip
def test_sampling_params_invented_knob_is_one_line(knob, value, hint):
    with pytest.raises(UnsupportedArgumentError) as e:
        SamplingParams(temperature=0.7, **{knob: value})
    msg = str(e.value)
    assert isinstance(e.value, TypeError) and e.value.key == knob
    assert "\n" not in msg and f"SamplingParams({knob}=...)" in msg and hint in msg
    assert 'LLM(model=..., speculative_config={"method": "draft_model"' in msg


@pytest.mark.parametrize("knob, value", [
    ("speculative_model", "/models/draft"), ("num_speculative_tokens", 4), ("speculative_sampling", True),
    ("speculative_ratio", 3), ("ngram_prompt_lookup_max", 4),
])  # fmt: skip
def test_llm_removed_knob_is_one_line_before_loading_anything(knob, value):
    with pytest.raises(UnsupportedArgumentError) as e:
        LLM(model="/nonexistent/model", **{knob: value})
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"LLM({knob}=...) is not an option")
    assert "speculative_config=" in msg


def test_sampling_params_accepts_vllm_keywords_at_their_no_op_values():
    assert specserve.SamplingParams is specserve.compat.SamplingParams  # the door translates; request.py is plain
    p = SamplingParams(temperature=0.8, top_p=0.95, top_k=-1, min_p=0.0, max_tokens=7, seed=3, stop="w9",
                       stop_token_ids=None, ignore_eos=False, n=1, presence_penalty=0.0, frequency_penalty=0,
                       repetition_penalty=1.0, logprobs=None, skip_special_tokens=True)  # fmt: skip
    assert p.stop == ["w9"] and p.stop_token_ids == [] and p.validate() is p and p.top_k == 0
    assert isinstance(p, specserve.request.SamplingParams)


@pytest.mark.parametrize("kw, key", [
    ({"n": 0}, "n"), ({"logits_processors": [print]}, "logits_processors"),
    ({"n": 3, "best_of": 2}, "best_of"), ({"use_beam_search": True}, "use_beam_search"), ({"bogus": 1}, "bogus"),
])  # fmt: skip
def test_sampling_params_unimplemented_vllm_keyword_is_one_line(kw, key):
    with pytest.raises(UnsupportedArgumentError) as e:
        SamplingParams(**kw)
    assert e.value.key == key and key in str(e.value) and "\n" not in str(e.value)


# --------------------------------------------------------------------------- config: the CLI's rules


def _cli_error(overrides: list[str]) -> str:
    with pytest.raises((ConfigError, UsageError)) as e:
        compose_config(overrides)
    return str(e.value)


@pytest.mark.parametrize("spec, overrides", [
    ({"method": "ngram", "num_speculative_tokens": 0}, ["+method=ngram", "method.num_speculative_tokens=0"]),
    ({"method": "ngram", "bogus_key": 1}, ["+method=ngram", "method.bogus_key=1"]),
    ({"method": "ngram", "temperature": 0.7}, ["+method=ngram", "method.temperature=0.7"]),
    ({"method": "ngram", "top_p": 0.9}, ["+method=ngram", "method.top_p=0.9"]),
    ({"method": "ngram", "tensor_parallel_size": 2}, ["+method=ngram", "method.tensor_parallel_size=2"]),
    ({"method": "ngram", "k": 2}, ["+method=ngram", "method.k=2"]),
    ({"method": "nope"}, ["+method=nope"]),
    ({"method": "ngram", "prompt_lookup_min": 6, "prompt_lookup_max": 3},
     ["+method=ngram", "method.prompt_lookup_min=6", "method.prompt_lookup_max=3"]),
    ({"method": "draft_model"}, ["+method=draft_model"]),
    ({"method": "ngram", "rejection_sample_method": "typical"}, ["+method=ngram", "method.rejection_sample_method=typical"]),
])  # fmt: skip
def test_speculative_config_errors_are_the_cli_lines(tiny_llama, spec, overrides):
    with pytest.raises(ConfigError) as e:
        LLM(model=str(tiny_llama), speculative_config=spec)
    assert str(e.value) == _cli_error(overrides)
    assert "\n" not in str(e.value)


def test_speculative_config_without_method_or_model_names_method():
    with pytest.raises(ConfigError, match=r"^method\.method: is required"):
        LLM(model="/nonexistent", speculative_config={"num_speculative_tokens": 3})


def test_a_tensor_parallel_size_the_model_cannot_split_is_refused_in_one_line(tiny_llama):
    # 4 attention heads over 2 KV heads cannot go to 3 ranks; refused before any worker starts.
    with pytest.raises(ConfigError) as e:
        LLM(model=str(tiny_llama), tensor_parallel_size=3)
    assert str(e.value).startswith("parallelism.tensor_parallel_size: 3 does not fit") and "\n" not in str(e.value)


def test_unknown_llm_keyword_is_one_line(tiny_llama):
    with pytest.raises(UnsupportedArgumentError, match=r"^LLM\(\) got an unknown argument 'swap_space'; engine options: "):
        LLM(model=str(tiny_llama), swap_space=4)


def test_llm_config_is_the_cli_composition(tiny_llama, tiny_draft, caplog):
    spec = {"model": str(tiny_draft), "num_speculative_tokens": 5, "method": "draft_model"}
    from specserve.compat import engine_overrides

    overrides, notes = engine_overrides(model=str(tiny_llama), speculative_config=spec, seed=42, max_model_len=256,
                                        gpu_memory_utilization=0.8, max_num_seqs=4)  # fmt: skip
    assert overrides == [
        f"model.path={tiny_llama}", f"model.name={tiny_llama}", "+method=draft_model", f"method.model={tiny_draft}",
        "method.num_speculative_tokens=5", "model.max_model_len=256", "engine.seed=42",
        "engine.gpu_memory_utilization=0.8", "engine.max_num_seqs=4",
    ]
    assert notes == []
    assert compose_config(overrides) == specserve.compat.compose(overrides)


@pytest.mark.parametrize("text", ["/tmp/a b/c=d,e", "it's", "tr\\", "a\\'b", "${oc.env:HOME}", "null", "1e-5", "x y]"])
def test_hydra_value_round_trips_any_path(text):
    cfg = compose_config([f"model.path={hydra_value(text)}"])
    assert cfg.model.path == text


# --------------------------------------------------------------------------- generate / chat


def test_generate_accepts_every_prompt_form(plain):
    tok = plain.tokenizer
    ids = [tok.encode(p) for p in PROMPTS]
    by_text = plain.generate(PROMPTS, greedy(), use_tqdm=False)
    assert [o.prompt for o in by_text] == PROMPTS
    assert [o.prompt_token_ids for o in by_text] == ids
    assert plain.generate(PROMPTS[0], greedy(), use_tqdm=False)[0].outputs == by_text[0].outputs
    by_ids = plain.generate(ids, greedy(), use_tqdm=False)
    assert texts(by_ids) == texts(by_text) and all(o.prompt is None for o in by_ids)
    assert texts(plain.generate(ids[1], greedy(), use_tqdm=False)) == texts(by_text)[1:2]
    dicts = [{"prompt": PROMPTS[0]}, {"prompt_token_ids": ids[1]}]
    assert texts(plain.generate(dicts, greedy(), use_tqdm=False)) == texts(by_text)[:2]
    per_prompt = [greedy(4), greedy(N), greedy(2, stop_token_ids=[])]
    outs = plain.generate(PROMPTS, per_prompt, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] <= [4, N, 2]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids[:n] for o, n in zip(by_text, (4, N, 2))]
    for o in by_text:
        c = o.outputs[0]
        assert o.finished and c.index == 0 and c.finish_reason in ("stop", "length")
        assert c.text and c.token_ids and o.spec_decode.num_drafts == 0 and o.mean_acceptance_length == 1.0


def test_generate_rejects_bad_inputs_in_one_line(plain):
    with pytest.raises(InvalidRequestError, match="sampling_params"):
        plain.generate(PROMPTS, [greedy()], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match=r"prompts\[1\]"):
        plain.generate(["w1", ""], greedy(), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        plain.generate(PROMPTS, greedy(100_000), use_tqdm=False)
    assert not plain.engine.requests and plain.engine.blocks.num_free == plain.engine.blocks.num_blocks


def test_progress_bar_counts_prompts(plain):
    bars = []

    class Bar:
        def __init__(self, total, **kw):
            self.total, self.n, self.closed = total, 0, False
            bars.append(self)

        def update(self, k):
            self.n += k

        def set_postfix_str(self, s):
            pass

        def close(self):
            self.closed = True

    plain.generate(PROMPTS, greedy(3), use_tqdm=Bar)
    assert [(b.total, b.n, b.closed) for b in bars] == [(3, 3, True)]
    plain.generate(PROMPTS, greedy(3))  # the real tqdm bar, on stderr


def test_speculative_greedy_equals_plain_greedy(plain, drafted, ngram):
    ref = plain.generate(PROMPTS, greedy(), use_tqdm=False)
    for llm in (drafted, ngram):
        outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
        assert sum(o.num_drafts for o in outs) > 0
        for o in outs:
            s = o.spec_decode
            assert o.mean_acceptance_length == 1 + s.num_accepted_tokens / max(s.num_drafts, 1) or s.num_drafts == 0
            assert o.acceptance_rate is None or 0 <= o.acceptance_rate <= 1
    assert sum(o.num_accepted_tokens for o in ngram.generate(PROMPTS, greedy(), use_tqdm=False)) > 0


def _cli_generate(capsys, model_dir, prompts: list[str], chat: bool) -> list[str]:
    plist = ",".join(hydra_value(p) for p in prompts)
    rc = generate_main([f"model.path={model_dir}", "model.dtype=float32", "engine.num_kv_blocks=128",
                        "engine.block_size=4", f"generate.prompts=[{plist}]", f"generate.max_tokens={N}",
                        f"generate.chat={str(chat).lower()}"])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    return re.findall(r"### prompt: [^\n]*\n(.*?)\n\[finish_reason=", out, re.S)


def test_greedy_generate_and_chat_equal_specserve_generate(plain, tiny_llama, capsys):
    assert texts(plain.generate(PROMPTS, greedy(), use_tqdm=False)) == _cli_generate(capsys, tiny_llama, PROMPTS, False)
    convs = [[{"role": "user", "content": p}] for p in PROMPTS]
    chat = plain.chat(convs, greedy(), use_tqdm=False)
    assert texts(chat) == _cli_generate(capsys, tiny_llama, PROMPTS, True)
    one = plain.chat(convs[0], greedy(), use_tqdm=False)
    assert len(one) == 1 and one[0].outputs == chat[0].outputs
    assert one[0].prompt_token_ids == plain.tokenizer.apply_chat_template(convs[0])


def test_greedy_output_equals_the_openai_server(drafted, plain):
    from specserve.engine.async_engine import AsyncEngine
    from specserve.engine.engine import LLMEngine
    from specserve.server import start_servers

    engine = AsyncEngine(LLMEngine(drafted.config), max_queue=16)
    srv = ServerConfig(host="127.0.0.1", grpc_port=0, http_port=0, api_key=None, api_key_env="", drain_timeout_s=5.0)
    handle = start_servers(srv, engine)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{handle.http_port}/v1", api_key="EMPTY", max_retries=0)
        model = client.models.list().data[0].id
        assert model == drafted.info.model_name
        offline = drafted.generate(PROMPTS, greedy(), use_tqdm=False)
        assert texts(offline) == texts(plain.generate(PROMPTS, greedy(), use_tqdm=False))
        for prompt, ref in zip(PROMPTS, offline):
            r = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=N, echo=False, n=1)
            assert r.choices[0].text == ref.outputs[0].text
            assert r.choices[0].finish_reason == ref.outputs[0].finish_reason
            assert r.model_extra["spec_decode"]["num_drafts"] == ref.num_drafts
        r = client.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=N)
        assert r.choices[0].message.content == drafted.chat(CHAT, greedy(), use_tqdm=False)[0].outputs[0].text
        client.close()
    finally:
        handle.stop()


# --------------------------------------------------------------------------- log-probabilities


def _check_vllm_logprobs(out, k: int, tokenizer) -> None:
    c = out.outputs[0]
    assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids) > 0
    for t, pos in zip(c.token_ids, c.logprobs):
        assert t in pos and set(range(1, k + 1)) <= {lp.rank for lp in pos.values()}
        assert pos[t].rank == 1  # greedy: the sampled token is the most likely
        assert all(lp.decoded_token == tokenizer.decode([i], skip_special_tokens=False) for i, lp in pos.items())
    assert c.cumulative_logprob == pytest.approx(sum(pos[t].logprob for t, pos in zip(c.token_ids, c.logprobs)))


def test_offline_logprobs_have_vllms_shape_and_the_engines_values(ngram):
    params = greedy(logprobs=3, prompt_logprobs=2)
    outs = ngram.generate(PROMPTS, params, use_tqdm=False)
    engine_outs = ngram.engine.generate([o.prompt_token_ids for o in outs], [params] * len(outs))
    for out, ref in zip(outs, engine_outs):
        _check_vllm_logprobs(out, 3, ngram.tokenizer)
        assert [pos[t].logprob for t, pos in zip(out.outputs[0].token_ids, out.outputs[0].logprobs)] == pytest.approx(
            [e.logprob for e in ref.logprobs], abs=1e-5)
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
        assert out.prompt_logprobs[0] is None and all(len(p) >= 2 for p in out.prompt_logprobs[1:])
    plain_out = ngram.generate(PROMPTS[0], greedy(), use_tqdm=False)[0]
    assert plain_out.outputs[0].logprobs is None and plain_out.outputs[0].cumulative_logprob is None
    assert plain_out.prompt_logprobs is None


def test_async_llm_streams_logprobs(tiny_llama, plain):
    ref = plain.generate(PROMPTS[0], greedy(logprobs=2), use_tqdm=False)[0].outputs[0]

    async def main():
        async with AsyncLLM(model=str(tiny_llama), **SMALL) as llm:
            return [out async for out in llm.generate(PROMPTS[0], greedy(logprobs=2))]

    streamed = asyncio.run(main())
    assert [len(o.outputs[0].logprobs or []) for o in streamed] == [len(o.outputs[0].token_ids) for o in streamed]
    last = streamed[-1]
    _check_vllm_logprobs(last, 2, plain.tokenizer)
    assert last.outputs[0].token_ids == ref.token_ids
    assert last.outputs[0].cumulative_logprob == pytest.approx(ref.cumulative_logprob, abs=1e-4)


# --------------------------------------------------------------------------- async


def test_llm_agenerate_returns_final_outputs(plain):
    ref = plain.generate(PROMPTS, greedy(), use_tqdm=False)

    async def main():
        return await plain.agenerate(PROMPTS, greedy())

    assert texts(asyncio.run(main())) == texts(ref)


def test_async_llm_streams_the_same_greedy_output(tiny_llama, tiny_draft, drafted):
    ref = drafted.generate(PROMPTS, greedy(), use_tqdm=False)
    spec = {"model": str(tiny_draft), "num_speculative_tokens": 3, "method": "draft_model"}

    async def main():
        async with AsyncLLM(model=str(tiny_llama), speculative_config=spec, **SMALL) as llm:
            streamed = []
            async for out in llm.generate(PROMPTS[0], greedy(), request_id="r0"):
                streamed.append(out)
            many = await llm.agenerate(PROMPTS, greedy())
            chat_text = ""
            async for out in llm.chat(CHAT, greedy()):
                chat_text += out.outputs[0].new_text
            async for _ in llm.generate(PROMPTS[1], greedy(400, ignore_eos=True)):
                break  # leaving early aborts the request
            deadline = asyncio.get_running_loop().time() + 30  # a safety net against a hang
            while llm.engine.engine.requests and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)
            return streamed, many, chat_text, dict(llm.engine.engine.requests)

    streamed, many, chat_text, left = asyncio.run(main())
    assert [o.finished for o in streamed] == [False] * (len(streamed) - 1) + [True]
    assert "".join(o.outputs[0].new_text for o in streamed) == streamed[-1].outputs[0].text == ref[0].outputs[0].text
    assert streamed[-1].request_id == "r0" and streamed[-1].num_drafts == ref[0].num_drafts
    assert texts(many) == texts(ref)
    assert chat_text == drafted.chat(CHAT, greedy(), use_tqdm=False)[0].outputs[0].text
    assert left == {}


def test_import_specserve_stays_light():
    code = ("import sys, specserve; from specserve import SamplingParams; SamplingParams(stop='x'); "
            "assert 'torch' not in sys.modules and 'specserve.llm' not in sys.modules, sorted(sys.modules)")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --------------------------------------------------------------------------- the embedded model (slow)

EXAMPLE = __import__("pathlib").Path(__file__).resolve().parents[1] / "examples" / "offline_inference.py"


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_offline_example_on_the_embedded_model(method):
    r = subprocess.run([sys.executable, str(EXAMPLE), method], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert re.match(r"Prompt: 'The future of AI is', Generated text: '.+'\n", r.stdout), r.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_embedded_greedy_equals_specserve_generate(capsys):
    llm = LLM(model="embedded:smollm2-135m-instruct", speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    ours = texts(llm.generate(["The future of AI is"], greedy(24), use_tqdm=False))
    rc = generate_main(["+method=ngram", "method.num_speculative_tokens=4", "generate.prompts=['The future of AI is']",
                        "generate.chat=false", "generate.max_tokens=24"])  # fmt: skip
    assert rc == 0
    assert ours == re.findall(r"### prompt: [^\n]*\n(.*?)\n\[finish_reason=", capsys.readouterr().out, re.S)
