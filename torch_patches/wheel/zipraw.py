"""Raw-copy zip rewriting: move compressed entries without recompressing.

A wheel is a zip archive. Rewriting a 540 MB torch wheel through
``zipfile`` inflates and deflates every entry; here unchanged entries are
copied as raw bytes (runs of consecutive entries in one ``copy_file_range``),
renamed entries get a new local header in front of their raw data, and only
the few changed entries are compressed again.
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass
from typing import BinaryIO, List, Optional, Tuple

from ..errors import TorchPatchesError

_CD = struct.Struct("<4s4B4HL2L5H2L")  # central directory record (46 bytes)
_LH = struct.Struct("<4s2B4HL2L2H")  # local file header (30 bytes)
_EOCD = struct.Struct("<4s4H2LH")  # end of central directory (22 bytes)
_EOCD64 = struct.Struct("<4sQ2H2L4Q")  # zip64 end of central directory (56 bytes)
_LOC64 = struct.Struct("<4sLQL")  # zip64 end of central directory locator (20 bytes)
_MAX32 = 0xFFFFFFFF
_UTF8 = 0x800


@dataclass
class Entry:
    """One member, as its central-directory record describes it."""

    name: str
    central: bytes  # the whole central record (fixed part, name, extra, comment)
    offset: int  # of the local header in the source
    end: int = 0  # where the next member (or the central directory) starts
    date_time: Tuple[int, int] = (0, 0)  # DOS time, date
    external_attr: int = 0
    create_system: int = 3
    method: int = 0
    compress_size: int = 0


def _zip64_values(extra: bytes) -> Tuple[int, int]:
    """(position inside ``extra`` of the zip64 block data, its length) or (-1, 0)."""
    i = 0
    while i + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, i)
        if tag == 1:
            return i + 4, size
        i += 4 + size
    return -1, 0


def read_entries(fh: BinaryIO) -> Tuple[List[Entry], int]:
    """Entries in local-header order, and the offset of the central directory."""
    fh.seek(0, os.SEEK_END)
    size = fh.tell()
    tail_len = min(size, 65536 + _EOCD.size)
    fh.seek(size - tail_len)
    tail = fh.read(tail_len)
    pos = tail.rfind(b"PK\x05\x06")
    if pos < 0:
        raise TorchPatchesError("not a zip file (no end of central directory)")
    _, _, _, _, count, cd_size, cd_offset, _ = _EOCD.unpack_from(tail, pos)
    if pos >= _LOC64.size and tail[pos - _LOC64.size:pos - _LOC64.size + 4] == b"PK\x06\x07":
        _, _, eocd64_offset, _ = _LOC64.unpack_from(tail, pos - _LOC64.size)
        fh.seek(eocd64_offset)
        fields = _EOCD64.unpack(fh.read(_EOCD64.size))
        count, cd_size, cd_offset = fields[7], fields[8], fields[9]
    fh.seek(cd_offset)
    cd = fh.read(cd_size)
    entries, i = [], 0
    for _ in range(count):
        fields = _CD.unpack_from(cd, i)
        if fields[0] != b"PK\x01\x02":
            raise TorchPatchesError("corrupt zip central directory")
        nlen, xlen, clen = fields[12], fields[13], fields[14]
        raw_name = cd[i + 46:i + 46 + nlen]
        extra = cd[i + 46 + nlen:i + 46 + nlen + xlen]
        offset, csize = fields[18], fields[10]
        at, _ = _zip64_values(extra)
        skip = 8 * (fields[11] == _MAX32)
        if csize == _MAX32:
            csize = struct.unpack_from("<Q", extra, at + skip)[0]
        if offset == _MAX32:
            skip += 8 * (fields[10] == _MAX32)
            offset = struct.unpack_from("<Q", extra, at + skip)[0]
        name = raw_name.decode("utf-8" if fields[5] & _UTF8 else "cp437")
        end = i + 46 + nlen + xlen + clen
        entries.append(Entry(name, cd[i:end], offset, date_time=(fields[7], fields[8]),
                             external_attr=fields[17], create_system=fields[2],
                             method=fields[6], compress_size=csize))
        i = end
    entries.sort(key=lambda e: e.offset)
    for a, b in zip(entries, entries[1:]):
        a.end = b.offset
    if entries:
        entries[-1].end = cd_offset
    return entries, cd_offset


def read_member(fh: BinaryIO, entry: Entry) -> bytes:
    """The uncompressed content of ``entry`` (stored or deflated)."""
    fh.seek(entry.offset)
    header = _LH.unpack(fh.read(_LH.size))
    if header[0] != b"PK\x03\x04":
        raise TorchPatchesError(f"corrupt local header for {entry.name}")
    fh.seek(entry.offset + _LH.size + header[10] + header[11])
    raw = fh.read(entry.compress_size)
    if entry.method == 0:
        return raw
    if entry.method == 8:
        return zlib.decompress(raw, -15)
    raise TorchPatchesError(f"{entry.name}: unsupported compression method {entry.method}")


def _copy_range(src: BinaryIO, dst: BinaryIO, start: int, length: int) -> None:
    """Copy ``length`` bytes at ``start`` of ``src`` to the end of ``dst``."""
    dst.flush()
    out_pos = dst.tell()
    sfd, dfd = src.fileno(), dst.fileno()
    done = 0
    try:
        while done < length:
            n = os.copy_file_range(sfd, dfd, length - done, start + done, out_pos + done)
            if n == 0:
                break
            done += n
    except (AttributeError, OSError):
        pass
    if done < length:
        src.seek(start + done)
        dst.seek(out_pos + done)
        left = length - done
        while left:
            chunk = src.read(min(left, 1 << 22))
            if not chunk:
                raise TorchPatchesError("unexpected end of zip file while copying")
            dst.write(chunk)
            left -= len(chunk)
    dst.seek(out_pos + length)


def _encode_name(name: str) -> Tuple[bytes, int]:
    try:
        return name.encode("ascii"), 0
    except UnicodeEncodeError:
        return name.encode("utf-8"), _UTF8


class RawZipWriter:
    """Write a zip from raw-copied source entries and a few new ones."""

    def __init__(self, src: BinaryIO, dst: BinaryIO):
        self.src, self.dst = src, dst
        self.central: List[bytes] = []
        self._run: Optional[List[int]] = None  # [source start, source end, output start]
        self._pending: List[Tuple[Entry, int]] = []

    def _flush(self) -> None:
        if self._run is not None:
            start, end, _ = self._run
            _copy_range(self.src, self.dst, start, end - start)
            self._run = None

    def _central_for(self, entry: Entry, new_offset: int, new_name: Optional[str] = None) -> bytes:
        fields = list(_CD.unpack_from(entry.central))
        nlen, xlen = fields[12], fields[13]
        name = entry.central[46:46 + nlen]
        extra = bytearray(entry.central[46 + nlen:46 + nlen + xlen])
        comment = entry.central[46 + nlen + xlen:]
        if new_name is not None:
            name, flag = _encode_name(new_name)
            fields[5] = (fields[5] & ~_UTF8) | flag
            fields[12] = len(name)
        if fields[18] == _MAX32:
            at, _ = _zip64_values(bytes(extra))
            skip = 8 * ((fields[11] == _MAX32) + (fields[10] == _MAX32))
            struct.pack_into("<Q", extra, at + skip, new_offset)
        elif new_offset >= _MAX32:
            raise TorchPatchesError("output wheel needs zip64 offsets, which are not supported")
        else:
            fields[18] = new_offset
        return _CD.pack(*fields) + name + bytes(extra) + comment

    def copy(self, entry: Entry) -> None:
        """Copy ``entry`` unchanged (joined with adjacent copies into one run)."""
        if self._run is not None and self._run[1] == entry.offset:
            self._run[1] = entry.end
        else:
            self._flush()
            self.dst.seek(0, os.SEEK_END)
            self._run = [entry.offset, entry.end, self.dst.tell()]
        out_offset = self._run[2] + (entry.offset - self._run[0])
        self.central.append(self._central_for(entry, out_offset))

    def rename(self, entry: Entry, new_name: str) -> None:
        """Copy ``entry``'s raw data under a new name (new local header)."""
        self._flush()
        self.src.seek(entry.offset)
        header = self.src.read(_LH.size)
        fields = list(_LH.unpack(header))
        if fields[0] != b"PK\x03\x04":
            raise TorchPatchesError(f"corrupt local header for {entry.name}")
        nlen, xlen = fields[10], fields[11]
        extra = self.src.read(nlen + xlen)[nlen:]
        name, flag = _encode_name(new_name)
        fields[3] = (fields[3] & ~_UTF8) | flag
        fields[10] = len(name)
        out_offset = self.dst.tell()
        self.dst.write(_LH.pack(*fields) + name + extra)
        data_start = entry.offset + _LH.size + nlen + xlen
        _copy_range(self.src, self.dst, data_start, entry.end - data_start)
        self.central.append(self._central_for(entry, out_offset, new_name))

    def add(self, name: str, data: bytes, like: Optional[Entry] = None, level: int = 6) -> None:
        """Write a new deflated entry (date and attributes taken from ``like``)."""
        self._flush()
        comp = zlib.compressobj(level, zlib.DEFLATED, -15)
        payload = comp.compress(data) + comp.flush()
        crc = zlib.crc32(data)
        raw_name, flag = _encode_name(name)
        time_, date = like.date_time if like else (0, (2020 - 1980) << 9 | 1 << 5 | 1)
        attr = like.external_attr if like else (0o644 << 16)
        system = like.create_system if like else 3
        if len(payload) >= _MAX32 or len(data) >= _MAX32:
            raise TorchPatchesError(f"{name} is too large for this writer")
        offset = self.dst.tell()
        if offset >= _MAX32:
            raise TorchPatchesError("output wheel needs zip64 offsets, which are not supported")
        self.dst.write(_LH.pack(b"PK\x03\x04", 20, 0, flag, 8, time_, date, crc,
                                len(payload), len(data), len(raw_name), 0) + raw_name)
        self.dst.write(payload)
        self.central.append(_CD.pack(b"PK\x01\x02", 20, system, 20, 0, flag, 8, time_, date, crc,
                                     len(payload), len(data), len(raw_name), 0, 0, 0, 0,
                                     attr, offset) + raw_name)

    def finish(self) -> None:
        """Write the central directory and end records."""
        self._flush()
        self.dst.seek(0, os.SEEK_END)
        cd_offset = self.dst.tell()
        cd = b"".join(self.central)
        self.dst.write(cd)
        count = len(self.central)
        if count >= 0xFFFF or cd_offset >= _MAX32 or len(cd) >= _MAX32:
            eocd64_offset = self.dst.tell()
            self.dst.write(_EOCD64.pack(b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, len(cd), cd_offset))
            self.dst.write(_LOC64.pack(b"PK\x06\x07", 0, eocd64_offset, 1))
            self.dst.write(_EOCD.pack(b"PK\x05\x06", 0, 0, min(count, 0xFFFF), min(count, 0xFFFF),
                                      min(len(cd), _MAX32), min(cd_offset, _MAX32), 0))
        else:
            self.dst.write(_EOCD.pack(b"PK\x05\x06", 0, 0, count, count, len(cd), cd_offset, 0))
