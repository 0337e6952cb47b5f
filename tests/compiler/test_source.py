"""The load stage's GGUF reading: each file parsed once within `gguf_parsed_once`, gguf's own
names put back after it. (That a GGUF build gives transformers' weights is checked end to end by
the SmolLM2 golden tests, whose reference is transformers' own loader.)"""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest

from trtc.compiler.source import gguf_parsed_once


def write_gguf(path, value: int) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("test.value", value)
    writer.add_tensor("token_embd.weight", np.arange(8, dtype=np.float32).reshape(2, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def value(reader) -> int:
    field = reader.fields["test.value"]
    return int(field.parts[field.data[0]][0])


def test_each_file_is_parsed_once_and_gguf_is_restored(tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_gguf(a, 1)
    write_gguf(b, 2)
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with gguf_parsed_once():
        first = gguf.GGUFReader(a)
        assert gguf.GGUFReader(str(a)) is first and value(first) == 1
        assert value(gguf.GGUFReader(b)) == 2 and gguf.GGUFReader(b) is not first
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
        # A file replaced in the block is parsed again.
        write_gguf(tmp_path / "new.gguf", 3)
        os.replace(tmp_path / "new.gguf", a)
        assert value(gguf.GGUFReader(a)) == 3
    assert gguf.GGUFReader is reader_class and gguf.get_tensor_name_map is name_map
    assert gguf.GGUFReader(a) is not gguf.GGUFReader(a)


def test_the_block_does_nothing_for_other_checkpoints(tmp_path):
    write_gguf(tmp_path / "a.gguf", 1)
    with gguf_parsed_once(active=False):
        assert gguf.GGUFReader(tmp_path / "a.gguf") is not gguf.GGUFReader(tmp_path / "a.gguf")


def test_gguf_is_restored_when_the_block_raises(tmp_path):
    reader_class = gguf.GGUFReader
    with pytest.raises(RuntimeError), gguf_parsed_once():
        raise RuntimeError("load failed")
    assert gguf.GGUFReader is reader_class
