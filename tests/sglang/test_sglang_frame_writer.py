"""The SGLang frame-0 writer on its own: what it names, what it refuses, frame 1's bytes.

These read the pickle's opcodes (``pickletools``) and never load it; SGLang's own
``safe_pickle_loads`` reads the same frames in ``test_sglang_receiver.py``.
"""

from __future__ import annotations

import ast
import pickle
import pickletools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from epd_trio.errors import RequestError
from epd_trio.protocol import sglang

RECEIVER = "sglang.srt.disaggregation.encoder.receiver"


def globals_named(frame: bytes) -> set[tuple[str, str]]:
    """Every (module, name) the pickle asks its loader for; all our globals are STACK_GLOBAL."""
    names: set[tuple[str, str]] = set()
    strings: list[str] = []
    memo: list[str | None] = []
    previous = ""
    for opcode, arg, _ in pickletools.genops(frame):
        assert opcode.name not in ("GLOBAL", "INST", "OBJ", "EXT1", "EXT2", "EXT4")
        if opcode.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(str(arg))
        elif opcode.name == "MEMOIZE":  # memoizes the stack top: a string only right after one
            memo.append(strings[-1] if previous.endswith("UNICODE") else None)
        elif opcode.name in ("BINGET", "LONG_BINGET") and memo[int(arg)] is not None:
            strings.append(str(memo[int(arg)]))
        elif opcode.name == "STACK_GLOBAL":
            names.add((strings[-2], strings[-1]))
        previous = opcode.name
    return names


def video_frame(dtype: torch.dtype = torch.bfloat16) -> list[object]:
    return sglang.embedding_message(
        torch.zeros(8, 4, dtype=dtype), req_id="r_local_part_0", part_idx=0, num_parts=1,
        modality="video", grid=[[2, 4, 4]], second_per_grid_ts=[1.0],
        video_timestamps=[[0.5, 1.5]])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_only_allow_listed_globals_are_named(dtype: torch.dtype) -> None:
    frame0 = bytes(video_frame(dtype)[0])  # type: ignore[arg-type]
    assert frame0[:2] == b"\x80\x04"  # protocol 4
    # Each of these is on SGLang 0.5.23's SafeUnpickler allow-list (or its storage hook).
    assert globals_named(frame0) == {
        (RECEIVER, "EmbeddingData"), ("sglang.srt.multimodal.modality", "Modality"),
        ("torch._utils", "_rebuild_tensor_v2"), ("torch.storage", "_load_from_bytes"),
        ("collections", "OrderedDict"), ("torch", str(dtype).removeprefix("torch.")),
    }


def test_an_error_frame_names_no_tensor_code() -> None:
    (frame0,) = sglang.error_message("r_local_part_1", 1, 2, "audio", RequestError("bad audio"))
    assert globals_named(bytes(frame0)) == {  # type: ignore[arg-type]
        (RECEIVER, "EmbeddingData"), ("sglang.srt.multimodal.modality", "Modality")}


@pytest.mark.parametrize(("dtype", "numpy_le"), [(torch.float16, "<f2"), (torch.float32, "<f4")])
def test_frame1_is_the_c_contiguous_little_endian_bytes(dtype: torch.dtype, numpy_le: str) -> None:
    values = torch.arange(24, dtype=torch.float32).reshape(4, 6).to(dtype)
    transposed = values.t()  # not contiguous: the writer must send the logical [6, 4] layout
    _frame0, frame1 = sglang.embedding_message(transposed, req_id="r", part_idx=0, num_parts=1,
                                              modality="image", grid=[[1, 4, 6]])
    got = np.frombuffer(frame1, dtype=numpy_le).reshape(6, 4)
    assert np.array_equal(got, transposed.contiguous().numpy())


def test_bfloat16_bytes_are_the_tensor_memory() -> None:
    values = torch.tensor([[1.0, -0.0, float("inf"), float("nan")]], dtype=torch.bfloat16)
    _, frame1 = sglang.embedding_message(values, req_id="r", part_idx=0, num_parts=1,
                                         modality="image", grid=[[1, 2, 2]])
    assert bytes(frame1) == values.view(torch.int16).numpy().astype("<i2").tobytes()


def test_a_grid_view_is_sent_without_its_batch() -> None:
    batch = torch.tensor([[1, 2, 2]] * 10_000)  # a slice of this drags all of it into a pickle
    frame0 = sglang.embedding_frame(req_id="r", part_idx=0, num_parts=1, modality="image",
                                    dtype=torch.bfloat16, shape=[1, 4], grid=batch[3:4])
    assert len(frame0) < 2_000


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"modality": "text"}, "modality must be one of"),
    ({"grid": [1, 2, 3]}, r"image grid must be \[n, 3\]"),
    ({"grid": [[1, 2]]}, r"image grid must be \[n, 3\]"),
    ({"grid": torch.zeros(0, 3)}, "n >= 1"),
    ({"modality": "audio"}, r"audio grid must be \[n\]"),
    ({"part_idx": 2}, "part_idx < num_parts"),
    ({"dtype": torch.float64}, "dtype must be one of"),
    ({"shape": [4, 0]}, "dim > 0"),
    ({"video_timestamps": [[float("nan")]]}, "finite"),
])
def test_malformed_fields_are_refused(kwargs: dict[str, object], match: str) -> None:
    fields: dict[str, object] = dict(req_id="r", part_idx=0, num_parts=2, modality="image",
                                     dtype=torch.float16, shape=[4, 8], grid=[[1, 4, 4]])
    with pytest.raises(ValueError, match=match):
        sglang.embedding_frame(**{**fields, **kwargs})  # type: ignore[arg-type]


def test_error_frames_carry_an_http_error_status() -> None:
    with pytest.raises(ValueError, match="HTTP error status"):
        sglang.error_frame(req_id="r", part_idx=0, num_parts=1, modality="image",
                           message="x", status=200)


def test_the_stand_ins_cannot_be_pickled_by_the_standard_pickler_by_mistake() -> None:
    # pickle.dumps would name epd_trio's stand-in, which SGLang refuses: only our pickler renames.
    frame = pickle.dumps(sglang._EmbeddingData({"req_id": "r"}))
    assert ("epd_trio.protocol.sglang", "_EmbeddingData") in globals_named(frame)


def test_the_writer_imports_no_sglang_and_no_trio() -> None:
    tree = ast.parse(Path(sglang.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not {name.split(".")[0] for name in imported} & {"sglang", "trio", "zmq"}
    code = ("import sys, torch; from epd_trio.protocol import sglang as s; "
            "s.embedding_message(torch.zeros(1, 2), req_id='r', part_idx=0, num_parts=1, "
            "modality='audio', grid=[300]); print([m for m in sys.modules if m.startswith('sglang')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
