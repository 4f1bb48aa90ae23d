"""Tensor descriptors, layout validation and hashing, demo layouts."""

from __future__ import annotations

import numpy as np
import pytest

from kvswap.client.errors import ErrorCode, InvalidTask
from kvswap.client.layout import (
    TensorDesc,
    demo_layout,
    layout_hash,
    parse_demo_layout,
    validate_layout,
)


def _d(name="k0", layer=0, dtype="<f2", shape=(8, 4, 2)):
    return TensorDesc(name, layer, dtype, shape, {"shm": "/x"})


def test_wire_round_trip():
    d = _d()
    back = TensorDesc.from_wire(d.to_wire())
    assert back == d and back.location == {"shm": "/x"}
    assert back.bytes_per_block == 4 * 2 * 2 and back.nbytes == 8 * 16


@pytest.mark.parametrize("wire, match", [
    ("notamap", "must be a map"),
    ({"name": "k0", "layer": 0, "dtype": "<f2"}, "misses field 'shape'"),
    ({"name": "../etc", "layer": 0, "dtype": "<f2", "shape": [1]}, "invalid tensor name"),
    ({"name": "k0", "layer": -1, "dtype": "<f2", "shape": [1]}, "layer"),
    ({"name": "k0", "layer": True, "dtype": "<f2", "shape": [1]}, "layer"),
    ({"name": "k0", "layer": 0, "dtype": "<f2", "shape": [0, 3]}, "positive"),
    ({"name": "k0", "layer": 0, "dtype": "<f2", "shape": []}, "positive"),
    ({"name": "k0", "layer": 0, "dtype": "nope", "shape": [1]}, "not a numpy scalar type"),
    # numpy raises SyntaxError for this one (it was INTERNAL_ERROR in the daemon)
    ({"name": "k0", "layer": 0, "dtype": ",f2", "shape": [1]}, "not a numpy scalar type"),
    ({"name": "k0", "layer": 0, "dtype": "f2,f2", "shape": [1]}, "not a numpy scalar type"),
    ({"name": "k0", "layer": 0, "dtype": "2f2", "shape": [1]}, "not a numpy scalar type"),
    ({"name": "k0", "layer": 0, "dtype": "O", "shape": [1]}, "cannot be copied"),
    ({"name": "k0", "layer": 0, "dtype": "S0", "shape": [1]}, "cannot be copied"),
    ({"name": "k0", "layer": 0, "dtype": "<f2", "shape": [1], "location": []}, "location"),
])
def test_from_wire_rejects(wire, match):
    with pytest.raises(InvalidTask, match=match) as ei:
        TensorDesc.from_wire(wire)
    assert ei.value.code == ErrorCode.BAD_LAYOUT


def test_validate_layout():
    assert validate_layout([_d("k0"), _d("v0", dtype="|u1")]) == 8
    with pytest.raises(InvalidTask, match="twice"):
        validate_layout([_d("k0"), _d("k0")])
    with pytest.raises(InvalidTask, match="same number of blocks"):
        validate_layout([_d("k0"), _d("v0", shape=(9, 4, 2))])
    with pytest.raises(InvalidTask, match="at least one"):
        validate_layout([])


def test_layout_hash_covers_block_layout_not_block_count():
    base = layout_hash([_d("k0"), _d("v0")])
    assert base == layout_hash([_d("k0", shape=(100, 4, 2)), _d("v0", shape=(100, 4, 2))])
    assert base != layout_hash([_d("v0"), _d("k0")])  # order is part of the layout
    assert base != layout_hash([_d("k0"), _d("v0", dtype="<f4")])
    assert base != layout_hash([_d("k0"), _d("v0", shape=(8, 2, 4))])
    assert base != layout_hash([_d("k0"), _d("v0", layer=1)])
    assert len(base) == 32


def test_demo_layouts():
    default = demo_layout()
    assert [t.name for t in default[:4]] == ["k0", "v0", "k1", "v1"] and len(default) == 16
    assert default[0].shape == (128, 16, 4, 64) and default[0].dtype == np.dtype("float16").str
    mla = demo_layout("mla=1,layers=3")
    assert [t.name for t in mla] == ["kv0", "kv1", "kv2"]
    fp8 = demo_layout("dtype=uint8,scales=1,layers=1,extra_layers=1")
    assert [t.name for t in fp8] == ["k0", "k0_scale", "v0", "v0_scale",
                                     "k1", "k1_scale", "v1", "v1_scale"]
    assert fp8[1].dtype == "<f4" and fp8[1].shape == (128, 16, 4) and fp8[4].layer == 1


@pytest.mark.parametrize("spec", ["layers", "bogus=1", "layers=x", "blocks=0", "heads=-1",
                                  "dtype=notatype", "dtype=2f2", "dtype=O"])
def test_demo_layout_rejects(spec):
    with pytest.raises(ValueError):  # what the CLI turns into a usage error
        parse_demo_layout(spec)
