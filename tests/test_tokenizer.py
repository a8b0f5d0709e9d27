"""Both tokenizers behind one interface; the HF path agrees with transformers' fast tokenizer."""

import itertools
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
    chats = [[{"role": "user", "content": "hi"}],
             [{"role": "system", "content": "be <|end|> brief"}, {"role": "user", "content": "1+1=<|"},
              {"role": "assistant", "content": "2"}, {"role": "user", "content": "é|>"}]]
    for chat, open_turn in itertools.product(chats, (True, False)):
        text = BYTE.chat_text(chat, add_generation_prompt=open_turn)
        assert BYTE.encode(text) == BYTE.apply_chat(chat, add_generation_prompt=open_turn)
    assert BYTE.chat_text(chats[0]) == "<|bos|><|user|>hi<|end|><|assistant|>"
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
    with pytest.raises(CheckpointError, match="no tokenizer files") as e:
        dlm_jax.load_tokenizer(empty)
    assert "\n" not in str(e.value)


def test_added_token_dicts_in_tokenizer_config(hf_dir):
    """Older tokenizer_config.json files store special tokens as AddedToken dicts."""
    cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    cfg["eos_token"] = {"__type": "AddedToken", "content": "<|eot|>", "special": True}
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = dlm_jax.load_tokenizer(hf_dir)
    assert tok.eos_id == tok.token_id("<|eot|>")


# -- chat templates as transformers 5 saves them (chat_template.jinja) --------------------------

RICH_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system = 'none' %}{%- endif %}"
    "{{ bos_token }}<|start|>system\n{{ system | tojson }}<|eot|>\n"
    "{%- for m in messages %}"
    "{%- if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role') }}{%- endif %}"
    "{%- if m['role'] == 'assistant' %}<|start|>assistant\n{% generation %}{{ m['content'] }}"
    "{% endgeneration %}{{ eos_token }}"
    "{%- else %}<|start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|eot|>{%- endif %}"
    "{%- if loop.last %}\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant\n{%- endif %}")
CHATS = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "12 + 30?"}],
         [{"role": "user", "content": "  the fox  "}, {"role": "assistant", "content": "42"},
          {"role": "user", "content": "ünïcödé ✓"}]]


def _saved_by_transformers(hf_dir, out, template):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(hf_dir)
    ref.chat_template = template
    ref.save_pretrained(out)
    return AutoTokenizer.from_pretrained(out)


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, RICH_TEMPLATE])
def test_chat_template_jinja_saved_by_transformers(hf_dir, tmp_path, template):
    ref = _saved_by_transformers(hf_dir, tmp_path / "saved", template)
    assert (tmp_path / "saved" / "chat_template.jinja").read_text() == template
    assert "chat_template" not in json.loads((tmp_path / "saved" / "tokenizer_config.json").read_text())
    ours = dlm_jax.load_tokenizer(tmp_path / "saved")
    assert ours.chat_template == template
    for messages in CHATS:
        want = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
        assert ours.apply_chat(messages) == want
        assert ours.apply_chat(messages, add_generation_prompt=False) == ref.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=False, return_dict=False)
        for open_turn in (True, False):
            assert ours.chat_text(messages, add_generation_prompt=open_turn) == ref.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=open_turn)
    if template is RICH_TEMPLATE:  # raise_exception, as in transformers, names the problem
        with pytest.raises(ValueError, match="bad role"):
            ours.apply_chat([{"role": "robot", "content": "x"}])


def test_jinja_file_wins_over_tokenizer_config(hf_dir, tmp_path):
    (hf_dir / "chat_template.jinja").write_text(RICH_TEMPLATE)  # tokenizer_config.json has CHAT_TEMPLATE
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(hf_dir)
    ours = dlm_jax.load_tokenizer(hf_dir)
    assert ours.chat_template == RICH_TEMPLATE == ref.chat_template
    assert ours.apply_chat(CHATS[0]) == ref.apply_chat_template(CHATS[0], tokenize=True,
                                                                add_generation_prompt=True, return_dict=False)


def test_save_writes_the_files_back_as_they_came(hf_dir, tmp_path):
    _saved_by_transformers(hf_dir, tmp_path / "saved", RICH_TEMPLATE)
    (tmp_path / "saved" / "special_tokens_map.json").write_text(json.dumps({"mask_token": "<|mdm_mask|>"}))
    for src in (tmp_path / "saved", hf_dir):  # .jinja file / template inside tokenizer_config.json
        out = tmp_path / f"copy-{src.name}"
        out.mkdir()
        dlm_jax.load_tokenizer(src).save(out)
        names = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"}
        written = {p.name: p.read_bytes() for p in out.iterdir()}
        assert written == {n: (src / n).read_bytes() for n in names if (src / n).exists()}
        assert dlm_jax.load_tokenizer(out).apply_chat(CHATS[1]) == dlm_jax.load_tokenizer(src).apply_chat(CHATS[1])


# -- prompt_format ------------------------------------------------------------------------------

def test_byte_tokenizer_prompt_format_round_trips(tmp_path):
    assert ByteTokenizer().prompt_format == "raw"
    for fmt in ("raw", "chat"):
        out = tmp_path / fmt
        out.mkdir()
        ByteTokenizer(prompt_format=fmt).save(out)
        config = json.loads((out / "tokenizer_config.json").read_text())
        assert ("prompt_format" in config) == (fmt == "chat")  # "raw" files stay as they were
        assert dlm_jax.load_tokenizer(out).prompt_format == fmt
    assert list(json.loads((tmp_path / "raw" / "tokenizer_config.json").read_text())) == [
        "tokenizer_class", "special_tokens"]
    with pytest.raises(dlm_jax.ConfigError, match="prompt_format='json'"):
        ByteTokenizer(prompt_format="json")
    config = json.loads((tmp_path / "chat" / "tokenizer_config.json").read_text())
    (tmp_path / "chat" / "tokenizer_config.json").write_text(json.dumps({**config, "prompt_format": "Chat"}))
    with pytest.raises(CheckpointError, match=r"tokenizer_config\.json: prompt_format='Chat' is not one of \['raw', 'chat'\]"):
        dlm_jax.load_tokenizer(tmp_path / "chat")


def test_hf_tokenizer_prompt_format(hf_dir):
    assert dlm_jax.load_tokenizer(hf_dir).prompt_format == "raw"
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({**config, "prompt_format": "chat"}))
    assert dlm_jax.load_tokenizer(hf_dir).prompt_format == "chat"
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({**config, "prompt_format": 1}))
    with pytest.raises(CheckpointError, match=r"tokenizer_config\.json: prompt_format=1 is not one of"):
        dlm_jax.load_tokenizer(hf_dir)


# -- several EOS ids (Llama-3 style) ------------------------------------------------------------

def test_hf_tokenizer_eos_ids(hf_dir):
    tok = dlm_jax.load_tokenizer(hf_dir)
    endoftext, eot, start = tok.token_id("<|endoftext|>"), tok.token_id("<|eot|>"), tok.token_id("<|start|>")
    assert tok.eos_ids == (endoftext,) and tok.eos_id == endoftext
    (hf_dir / "config.json").write_text(json.dumps({"eos_token_id": [eot, endoftext]}))
    (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [eot, start]}))
    tok = dlm_jax.load_tokenizer(hf_dir)
    assert tok.eos_ids == (eot, endoftext, start) and tok.eos_id == eot
    (hf_dir / "config.json").unlink()
    assert dlm_jax.load_tokenizer(hf_dir).eos_ids == (endoftext, eot, start)
    assert BYTE.eos_ids == (BYTE.eos_id,)


# -- token bytes (OpenAI's logprobs `bytes`) -----------------------------------------------------

@settings(max_examples=100, deadline=None)
@given(st.text())
def test_byte_token_bytes_spell_the_text(text):
    assert b"".join(BYTE.token_bytes(i) for i in BYTE.encode(text)) == text.encode()


def test_hf_byte_level_token_bytes_spell_the_text(hf_dir):
    """GPT-2's byte-level alphabet read back (the same table as transformers'
    `bytes_to_unicode`): a character split over tokens gives each its own bytes."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from dlm_jax._tokenizer import _UNICODE_BYTES

    assert _UNICODE_BYTES == {c: b for b, c in bytes_to_unicode().items()}
    ours = dlm_jax.load_tokenizer(hf_dir)
    for text in TEXTS:
        ids = ours.encode(text)
        assert b"".join(ours.token_bytes(i) for i in ids) == text.encode(), text
    pieces = [ours.token_bytes(i) for i in ours.encode("ü")]
    assert len(pieces) == 2 and b"".join(pieces) == "ü".encode()  # (not in the vocabulary whole)


def test_hf_byte_fallback_token_bytes_spell_the_text(tmp_path):
    """A SentencePiece-style tokenizer (Llama's layout: ▁ for a space, <0xNN> byte pieces for
    what the vocabulary lacks): each token's bytes, the first one's space included."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    for piece in ["▁", "a", "b", "c", "▁a", "▁b", "ab", "▁ab"]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "a"), ("▁", "b"), ("a", "b"), ("▁a", "b")],
                               unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.save(str(tmp_path / "tokenizer.json"))
    ours = dlm_jax.load_tokenizer(tmp_path)
    for text in ["ab c", "é ab ✓", "abc"]:
        ids = ours.encode(text)
        assert ours.decode(ids) == text
        assert b"".join(ours.token_bytes(i) for i in ids) == (" " + text).encode(), text
    assert [ours.token_bytes(i) for i in ours.encode("é")][-2:] == [b"\xc3", b"\xa9"]
    # the same vocabulary under the `Metaspace` decoder (how newer tokenizers write it)
    tok.decoder = decoders.Sequence([decoders.Metaspace(replacement="▁"), decoders.ByteFallback(), decoders.Fuse()])
    tok.save(str(tmp_path / "tokenizer.json"))
    ours = dlm_jax.load_tokenizer(tmp_path)
    ids = ours.encode("é ab")
    assert b"".join(ours.token_bytes(i) for i in ids) == " é ab".encode()
