"""Bodies between processes: JSON or safetensors with the JSON in its metadata; optional per-tensor digests."""

import json
import struct

import pytest
import torch

from rlhf.transport import wire


def test_json_and_tensor_bodies_round_trip():
    body, ctype = wire.encode({"a": [1, 2]})
    assert ctype == wire.JSON_TYPE and wire.decode(body, ctype) == ({"a": [1, 2]}, {})
    t = {"x": torch.randn(3, 4), "ids": torch.arange(5), "empty": torch.zeros(0)}
    body, ctype = wire.encode({"step": 2}, t)
    obj, out = wire.decode(body, ctype)
    assert ctype == wire.TENSORS_TYPE and obj == {"step": 2}
    assert all(torch.equal(out[k], v) for k, v in t.items())
    assert wire.decode(b"", wire.JSON_TYPE) == (None, {})


def test_checksums_travel_only_when_asked():
    t = {"x": torch.arange(6.0)}
    plain, _ = wire.encode({}, t)
    summed, _ = wire.encode({}, t, checksums=True)
    header = lambda body: json.loads(body[8 : 8 + struct.unpack("<Q", body[:8])[0]])["__metadata__"]  # noqa: E731
    assert "sha256" not in header(plain)
    digest, shape = json.loads(header(summed)["sha256"])["x"]
    assert shape == [6] and len(digest) == 64


def test_a_tensor_changed_after_its_digest_was_taken_is_named():
    t = {"w": torch.arange(8.0).view(2, 4)}
    sums = wire.digests(t)  # taken where the tensor was made
    body, ctype = wire.encode({}, {"w": t["w"][:, :2].contiguous()}, sums)  # changed in transit
    with pytest.raises(wire.CorruptPayload, match=r"tensor 'w' arrived with shape \[2, 2\].*sent with shape \[2, 4\]"):
        wire.decode(body, ctype)


@pytest.mark.parametrize("cut", [4, 7, 12])
def test_cut_bodies_fail_with_a_clear_error(cut):
    body, ctype = wire.encode({"a": 1}, {"x": torch.arange(10.0)})
    with pytest.raises(ValueError):
        wire.decode(body[:cut], ctype)
