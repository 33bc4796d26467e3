"""Megatron .bin/.idx: exact byte layout, corrupt files, Megatron-LM interoperability."""

import os
import struct
import warnings

import numpy as np
import pytest

from megaq.data.errors import DataError
from megaq.data.indexed import IndexedDataset, IndexedDatasetWriter

DOCS = [[5, 6, 7], [8], [9, 10, 11, 12, 65535]]


def write(prefix, docs=DOCS, dtype=np.uint16):
    w = IndexedDatasetWriter(str(prefix), dtype)
    for d in docs:
        w.add_document(d)
    w.finish()
    w.commit()
    return str(prefix)


def test_layout_matches_reference_bytes(tmp_path):
    """Hand-packed from the format spec (docs/DATA.md, REFERENCE.md), independent of the writer."""
    p = write(tmp_path / "a")
    lengths = [len(d) for d in DOCS]
    expect = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8)
              + struct.pack("<QQ", 3, 4) + struct.pack("<3i", *lengths)
              + struct.pack("<3q", 0, 6, 8) + struct.pack("<4q", 0, 1, 2, 3))
    assert open(p + ".idx", "rb").read() == expect
    assert open(p + ".bin", "rb").read() == struct.pack("<9H", *sum(DOCS, []))
    ds = IndexedDataset(p)
    assert [ds[i].tolist() for i in range(len(ds))] == DOCS
    assert ds.get(2, 1, 2).tolist() == [10, 11] and ds.num_tokens == 9
    assert os.listdir(tmp_path) == sorted(os.listdir(tmp_path)) and len(os.listdir(tmp_path)) == 2


def test_writer_abort_leaves_nothing(tmp_path):
    w = IndexedDatasetWriter(str(tmp_path / "x"), np.uint16)
    w.add_document([1, 2])
    w.finish()
    w.abort()
    assert os.listdir(tmp_path) == []


def corrupt(path, how):
    data = bytearray(open(path, "rb").read())
    if how == "magic":
        data[0:4] = b"XXXX"
    elif how == "version":
        data[9:17] = struct.pack("<Q", 2)
    elif how == "truncate_header":
        data = data[:20]
    elif how == "truncate_body":
        data = data[:-5]
    elif how == "truncate_bin":
        data = data[:-3]
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("how,ext,expect", [
    ("magic", ".idx", "bad magic at offset 0"),
    ("version", ".idx", "unsupported version 2 at offset 9"),
    ("truncate_header", ".idx", "truncated at byte 20"),
    ("truncate_body", ".idx", "truncated: 97 bytes"),
    ("truncate_bin", ".bin", "15 bytes but"),
])
def test_corrupt_files_one_line_error(tmp_path, how, ext, expect):
    p = write(tmp_path / "a")
    corrupt(p + ext, how)
    with pytest.raises(DataError) as e:
        IndexedDataset(p)
    msg = str(e.value)
    assert expect in msg and (p + ext) in msg and "regenerate" in msg and "\n" not in msg


def set_field(path, offset, fmt, value):
    """Overwrite one little-endian field of a file in place (one corrupted number)."""
    data = bytearray(open(path, "rb").read())
    struct.pack_into(fmt, data, offset, value)
    open(path, "wb").write(bytes(data))


# DOCS' .idx: header 34 bytes, int32 lengths at 34, int64 pointers at 46, int64 doc
# boundaries at 70
@pytest.mark.parametrize("offset,fmt,value,expect", [
    (34 + 4, "<i", 100_000_000, "sequence 2 starts at byte 8 of the .bin but the lengths before "
                                "it put it at 200000006"),
    (34 + 4, "<i", -5, "corrupt sequence length -5 (sequence 1)"),
    # the last length: the .bin is then too short
    (34 + 8, "<i", 100_000_000, "says 200000008 (truncated .bin"),
    (46 + 8, "<q", 10**12, "sequence 1 starts at byte 1000000000000"),
    (46 + 16, "<q", 10**12, "sequence 2 starts at byte 1000000000000"),
    (70 + 8, "<q", 10**6, "boundary 2 (2) is below the one before it (1000000)"),
    (17, "<B", 2, "its dtype code 2 says 1-byte int8 tokens, the offsets say 2-byte ones"),
])
def test_one_corrupt_idx_field_is_one_line_error(tmp_path, offset, fmt, value, expect):
    """Any single corrupted number in the .idx is found when the dataset is opened, not as
    a ValueError mid-training or as silently wrong tokens."""
    p = write(tmp_path / "a")
    set_field(p + ".idx", offset, fmt, value)
    with pytest.raises(DataError) as e:
        IndexedDataset(p)
    msg = str(e.value)
    assert expect in msg and "\n" not in msg, msg
    assert msg.startswith(p) and "regenerate" in msg and "tools/preprocess_data.py" in msg


def test_wrong_dtype_code_on_a_single_sequence_is_found_by_the_bin_size(tmp_path):
    p = write(tmp_path / "a", [[1, 2, 3, 4]])
    set_field(p + ".idx", 17, "<B", 2)  # int8 on a uint16 .bin: the offsets cannot tell
    with pytest.raises(DataError, match=r"a\.bin: 8 bytes but .*a\.idx says 4 .*dtype code says "
                                        r"1-byte int8 tokens, the \.bin holds 2-byte ones"):
        IndexedDataset(p)


def test_bin_longer_than_its_idx_says(tmp_path):
    p = write(tmp_path / "a")
    with open(p + ".bin", "ab") as f:
        f.write(b"\0" * 3)
    with pytest.raises(DataError, match=r"a\.bin: 21 bytes but .* says 18 \(the index does not "
                                        r"match this \.bin\); regenerate"):
        IndexedDataset(p)


def test_missing_files(tmp_path):
    with pytest.raises(DataError, match="pass the prefix without extension"):
        IndexedDataset(str(tmp_path / "nothing"))
    p = write(tmp_path / "a")
    os.remove(p + ".bin")
    with pytest.raises(DataError, match=r"a\.bin: missing"):
        IndexedDataset(p)


# -- Megatron-LM interoperability (optional test dependency: megatron-core) ----------

@pytest.fixture(scope="module")
def megatron():
    """Megatron-LM's indexed_dataset module, or skip (listed first so nothing is built)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets import indexed_dataset
    except ImportError:
        pytest.skip("megatron-core not installed: `pip install megatron-core` (CPU torch is "
                    "enough) to run the Megatron-LM interoperability tests")
    return indexed_dataset


def test_megatron_reads_our_files(megatron, tiny_dataset):
    mi = megatron
    theirs, ours = mi.IndexedDataset(tiny_dataset), IndexedDataset(tiny_dataset)
    assert len(theirs) == len(ours) > 100
    assert np.array_equal(theirs.sequence_lengths, ours.sequence_lengths)
    assert np.array_equal(theirs.document_indices, ours.document_indices)
    assert theirs.index.dtype == ours.dtype
    for i in range(len(ours)):
        assert np.array_equal(theirs[i], ours[i])
    assert np.array_equal(theirs.get(7, offset=3, length=5), ours.get(7, 3, 5))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # numpy 2 vs Megatron's builder
@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_writes_same_bytes_and_we_read_theirs(megatron, tmp_path, tiny_dataset, dtype):
    import torch

    mi = megatron
    ours = IndexedDataset(tiny_dataset)
    docs = [np.asarray(ours[i]) for i in range(len(ours))]
    prefix = str(tmp_path / "meg")
    builder = mi.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for d in docs:
        builder.add_document(torch.from_numpy(d.astype(np.int64)), [len(d)])
    builder.finalize(prefix + ".idx")
    mine = write(tmp_path / "mine", docs, dtype)
    for ext in (".bin", ".idx"):
        assert open(prefix + ext, "rb").read() == open(mine + ext, "rb").read()
    back = IndexedDataset(prefix)
    assert back.dtype == dtype and all(np.array_equal(back[i], d) for i, d in enumerate(docs))
