"""Char tokenizer behaves like an HF tokenizer; a saved model directory loads back identically."""

import torch

from rlhf.config import ModelConfig
from rlhf.data import encode_prompts
from rlhf.models import build_model_and_tokenizer, count_parameters
from rlhf.models.tokenizer import CharTokenizer
from rlhf.rollout.engine import RolloutEngine
from rlhf.weights import checksum, export_state, save_state_dir


def test_char_tokenizer_roundtrip_padding_and_specials(tmp_path):
    tok = CharTokenizer()
    ids = tok.encode("12+3=")
    assert ids[0] == tok.bos_token_id and len(ids) == 6
    assert tok.decode(ids) == "12+3=" and tok.decode(ids + [tok.eos_token_id, tok.pad_token_id]) == "12+3="
    assert tok.decode(ids, skip_special_tokens=False).startswith("<bos>")
    batch = tok(["1+1=", "10+10="], return_tensors="pt")
    assert batch["input_ids"].shape == (2, 7)
    assert batch["attention_mask"][0].tolist() == [0, 0, 1, 1, 1, 1, 1]  # left padding, as for generation
    assert batch["input_ids"][0, 0].item() == tok.pad_token_id
    assert tok.encode("é", add_special_tokens=False) == [tok.unk_token_id]
    tok.save_pretrained(str(tmp_path))
    again = CharTokenizer.from_pretrained(str(tmp_path))
    assert again.encode("99*9=") == tok.encode("99*9=") and again.vocab_size == tok.vocab_size


def test_tiny_preset_is_about_a_million_parameters(tiny):
    model, tok = tiny
    assert 0.5e6 < count_parameters(model) < 1.5e6
    assert model.config.model_type == "llama" and model.config.vocab_size == tok.vocab_size


def test_local_model_directory_loads_the_same_weights_and_tokenizer(diverse, tmp_path):
    model, tok = diverse
    save_state_dir(model, str(tmp_path), tok)
    loaded, loaded_tok = build_model_and_tokenizer(ModelConfig(path=str(tmp_path)))
    assert checksum(export_state(loaded)) == checksum(export_state(model))
    assert isinstance(loaded_tok, CharTokenizer)
    prompts = encode_prompts(tok, ["1+2=", "40+41="])
    params = {"max_new_tokens": 6, "temperature": 0}
    assert [r["output_ids"] for r in RolloutEngine(loaded, loaded_tok).generate(prompts, params)] == \
           [r["output_ids"] for r in RolloutEngine(model, tok).generate(prompts, params)]
    # and the rollout engine can load the same directory as a weights update (disk mode)
    fresh, _ = build_model_and_tokenizer(ModelConfig(name="tiny-llama"), seed=5)
    engine = RolloutEngine(fresh, tok)
    engine.update_weights_from_disk(str(tmp_path), weight_version="4")
    assert engine.weights_checksum() == checksum(export_state(model)) and engine.weight_version == "4"
    assert torch.equal(fresh.lm_head.weight, fresh.model.embed_tokens.weight)  # tie preserved


def _save_on_rank_1(rank: int, directory: str, store: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        if rank == 1:
            model, tok = build_model_and_tokenizer(ModelConfig(name="tiny-llama"), seed=3)
            save_state_dir(model, directory, tok)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_any_rank_of_a_distributed_world_writes_a_loadable_model_dir(tmp_path):
    """transformers' save_pretrained writes nothing on a rank other than 0 of a torch.distributed world; ours
    does (the weights fallback may pick rank 1), tied weights once, and the directory loads back the same."""
    import torch.multiprocessing as mp

    directory = str(tmp_path / "dir")
    mp.spawn(_save_on_rank_1, args=(directory, str(tmp_path / "store")), nprocs=2)
    model, _ = build_model_and_tokenizer(ModelConfig(name="tiny-llama"), seed=3)
    loaded, _ = build_model_and_tokenizer(ModelConfig(path=directory))
    assert checksum(export_state(loaded)) == checksum(export_state(model))
    from safetensors import safe_open

    with safe_open(str(tmp_path / "dir" / "model.safetensors"), "pt") as fh:
        assert "lm_head.weight" not in fh.keys() and "model.embed_tokens.weight" in fh.keys()  # tied: once
