"""Both tokenizers behind one interface; the HF path agrees with transformers' fast tokenizer."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dlm_jax
from dlm_jax import ByteTokenizer, CheckpointError, HFTokenizer

BYTE = ByteTokenizer()
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|eot|>{% endfor %}{% if add_generation_prompt %}<|start|>assistant\n{% endif %}")


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_round_trip(text):
    ids = BYTE.encode(text)
    assert all(0 <= i < BYTE.vocab_size for i in ids)
    assert BYTE.decode(ids, skip_special=False) == text


def test_byte_specials_and_chat():
    assert BYTE.encode("a<|mask|>b") == [97, BYTE.mask_id, 98]
    assert BYTE.decode([97, BYTE.mask_id, 98]) == "ab"
    assert len({BYTE.mask_id, BYTE.eos_id, BYTE.pad_id, BYTE.bos_id}) == 4
    ids = BYTE.apply_chat([{"role": "user", "content": "hi"}])
    assert BYTE.decode(ids, skip_special=False) == "<|bos|><|user|>hi<|end|><|assistant|>"
    with pytest.raises(ValueError, match="unknown chat role 'robot'"):
        BYTE.apply_chat([{"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match="token id 999"):
        BYTE.decode([999])


@pytest.fixture
def hf_dir(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<|endoftext|>", "<|mdm_mask|>", "<|start|>", "<|eot|>", "<s>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["the quick brown fox jumps over the lazy dog " * 3, "def add(a, b):\n    return a + b\n",
              "12 + 30 = 42; 7 * 6 = 42"] * 20
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE}))
    return tmp_path


TEXTS = ["the lazy fox returns 42", "def f(x):\n    return x * 6", "ünïcödé ✓ <|mdm_mask|> end", ""]


def test_hf_tokenizer_matches_transformers(hf_dir):
    from transformers import PreTrainedTokenizerFast

    ours = dlm_jax.load_tokenizer(hf_dir)
    ref = PreTrainedTokenizerFast(tokenizer_file=str(hf_dir / "tokenizer.json"))
    assert isinstance(ours, HFTokenizer)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert ours.mask_id == ref.convert_tokens_to_ids("<|mdm_mask|>")
    assert ours.eos_id == ref.convert_tokens_to_ids("<|endoftext|>")
    assert ours.bos_id == ref.convert_tokens_to_ids("<s>")
    assert ours.vocab_size == len(ref)


def test_hf_chat_template_matches_transformers(hf_dir):
    from transformers import AutoTokenizer

    ours = dlm_jax.load_tokenizer(hf_dir)
    ref = AutoTokenizer.from_pretrained(hf_dir)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "12 + 30?"}]
    assert ours.apply_chat(messages) == ref.apply_chat_template(messages, add_generation_prompt=True,
                                                                 tokenize=True, return_dict=False)


def test_mask_id_from_model_config_wins(hf_dir):
    (hf_dir / "config.json").write_text(json.dumps({"mask_token_id": 7}))
    assert dlm_jax.load_tokenizer(hf_dir).mask_id == 7


def test_hf_tokenizer_saves_and_reloads(hf_dir, tmp_path):
    ours = dlm_jax.load_tokenizer(hf_dir)
    out = tmp_path / "copy"
    out.mkdir()
    ours.save(out)
    again = dlm_jax.load_tokenizer(out)
    assert again.encode(TEXTS[0]) == ours.encode(TEXTS[0]) and again.mask_id == ours.mask_id


def test_bad_tokenizer_files(hf_dir, tmp_path):
    (hf_dir / "tokenizer.json").write_text('{"version": "1.0", "model": 3')
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: cannot load tokenizer"):
        dlm_jax.load_tokenizer(hf_dir)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        dlm_jax.load_tokenizer(empty)


def test_added_token_dicts_in_tokenizer_config(hf_dir):
    """Older tokenizer_config.json files store special tokens as AddedToken dicts."""
    cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    cfg["eos_token"] = {"__type": "AddedToken", "content": "<|eot|>", "special": True}
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = dlm_jax.load_tokenizer(hf_dir)
    assert tok.eos_id == tok.token_id("<|eot|>")
