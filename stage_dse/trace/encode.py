"""Chakra ET wire format: a hand-rolled encoder for the nodes we emit, and a reader.

What lives here: byte-level encoding of ``GlobalMetadata`` and ``Node`` messages (proto3 rules:
zero scalars omitted, repeated scalars packed, oneof members always present), the
length-delimited framing (unsigned varint length, then the message), and a reader that decodes
files through the generated module ``et_def_pb2`` (from ``et_def.proto`` beside this file).
The encoder exists because traces of 100K+ ranks are stamped from pre-encoded bytes; a test
checks it byte for byte against protobuf's own serialization.
"""

from __future__ import annotations

from collections.abc import Iterator
from enum import IntEnum
from functools import lru_cache
from pathlib import Path

__all__ = [
    "CollType",
    "NodeType",
    "attr_bool",
    "attr_int32",
    "attr_int64",
    "attr_string",
    "attr_uint64",
    "frame",
    "metadata",
    "node",
    "read_trace",
    "varint",
]

SCHEMA_VERSION = "0.0.4"


class NodeType(IntEnum):
    COMP_NODE = 4
    COMM_SEND_NODE = 5
    COMM_RECV_NODE = 6
    COMM_COLL_NODE = 7


class CollType(IntEnum):
    ALL_REDUCE = 0
    ALL_GATHER = 2
    ALL_TO_ALL = 6
    REDUCE_SCATTER = 7


SUPPORTED_COLLECTIVES = frozenset(int(c) for c in CollType)


def _varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_SMALL = 1 << 14
_VARINTS = [bytes([n]) for n in range(0x80)] + [
    bytes([(n & 0x7F) | 0x80, n >> 7]) for n in range(0x80, _SMALL)
]
"""Encodings of 0 .. 2**14 - 1 (one or two bytes): node ids, dependencies, most sizes."""


def varint(n: int) -> bytes:
    if 0 <= n < _SMALL:
        return _VARINTS[n]
    return _varint(n)


def _key(field: int, wire: int) -> bytes:
    return varint((field << 3) | wire)


def _len_field(field: int, payload: bytes) -> bytes:
    return _key(field, 2) + varint(len(payload)) + payload


def _attr(name: str, field: int, wire: int, payload: bytes) -> bytes:
    body = _len_field(1, name.encode()) + _key(field, wire) + payload
    return _len_field(10, body)


# attribute values repeat within a set (sizes, types, flags): encoded once each
_CACHE = 1 << 16


@lru_cache(maxsize=_CACHE)
def attr_bool(name: str, value: bool) -> bytes:
    return _attr(name, 27, 0, varint(int(value)))


@lru_cache(maxsize=_CACHE)
def attr_int32(name: str, value: int) -> bytes:
    return _attr(name, 7, 0, varint(value))


@lru_cache(maxsize=_CACHE)
def attr_int64(name: str, value: int) -> bytes:
    return _attr(name, 9, 0, varint(value))


@lru_cache(maxsize=_CACHE)
def attr_uint64(name: str, value: int) -> bytes:
    return _attr(name, 13, 0, varint(value))


@lru_cache(maxsize=_CACHE)
def attr_string(name: str, value: str) -> bytes:
    data = value.encode()
    return _attr(name, 29, 2, varint(len(data)) + data)


def _packed(field: int, values: list[int]) -> bytes:
    if not values:
        return b""
    return _len_field(field, b"".join(map(varint, values)))


@lru_cache(maxsize=_CACHE)
def _name_field(name: str) -> bytes:
    return _len_field(2, name.encode())


_ID_KEY, _DURATION_KEY = _key(1, 0), _key(7, 0)
_TYPE_FIELD = {t: _key(3, 0) + varint(int(t)) for t in NodeType}


def node(
    node_id: int,
    name: str,
    node_type: NodeType,
    data_deps: list[int] = (),  # type: ignore[assignment]
    ctrl_deps: list[int] = (),  # type: ignore[assignment]
    duration_micros: int = 0,
    attrs: bytes = b"",
) -> bytes:
    """Serialized ``Node`` (fields in number order, as protobuf writes them)."""
    parts = [_ID_KEY + varint(node_id)] if node_id else []
    if name:
        parts.append(_name_field(name))
    parts.append(_TYPE_FIELD.get(node_type) or _key(3, 0) + varint(int(node_type)))
    if ctrl_deps:
        parts.append(_packed(4, list(ctrl_deps)))
    if data_deps:
        parts.append(_packed(5, list(data_deps)))
    if duration_micros:
        parts.append(_DURATION_KEY + varint(duration_micros))
    parts.append(attrs)
    return b"".join(parts)


def metadata(version: str = SCHEMA_VERSION) -> bytes:
    """Serialized ``GlobalMetadata`` (version always set: an empty message would read as EOF)."""
    return _len_field(1, version.encode())


def frame(message: bytes) -> bytes:
    return varint(len(message)) + message


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("a length runs past the end of the file")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def read_trace(path: str | Path):
    """(GlobalMetadata, iterator of Node) of one ``<prefix>.<rank>.et`` file. A file that is
    truncated or does not decode raises a ``ConfigError`` naming it (while iterating, for a
    node past the metadata)."""
    from google.protobuf.message import DecodeError

    from stage_dse.errors import ConfigError
    from stage_dse.trace import et_def_pb2 as pb

    def corrupt(at: int, why: str) -> ConfigError:
        return ConfigError(
            f"{path}: not a readable trace file at byte {at} ({why}): truncated or corrupted; "
            "write the set again"
        )

    data = Path(path).read_bytes()

    def message(msg, p: int) -> int:
        try:
            size, start = _read_varint(data, p)
        except ValueError as exc:
            raise corrupt(p, str(exc)) from None
        if start + size > len(data):
            raise corrupt(p, f"a {size}-byte message runs past the end of the file")
        try:
            msg.ParseFromString(data[start : start + size])
        except DecodeError as exc:
            raise corrupt(p, str(exc).split(": ")[-1]) from None
        return start + size

    meta = pb.GlobalMetadata()
    if not data:
        raise corrupt(0, "empty file")
    pos = message(meta, 0)

    def nodes() -> Iterator[pb.Node]:
        p = pos
        while p < len(data):
            msg = pb.Node()
            p = message(msg, p)
            yield msg

    return meta, nodes()
