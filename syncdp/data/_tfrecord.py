"""The TFRecord format: counting records fast, checking them, and writing shards.

A TFRecord file is a sequence of records, each framed as::

    uint64 length | uint32 masked_crc32c(length) | byte data[length] | uint32 masked_crc32c(data)

Counting reads only the 12-byte header of each record and skips the payload, so it costs one
small read per record whatever the record size. Checking the payload checksums (``verify``)
reads every byte once, through TensorFlow's own C++ reader.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import struct
from collections.abc import Iterable, Mapping

import numpy as np

from syncdp.base.errors import DataError

__all__ = ["count_records", "write_tfrecord_shards"]

_HEADER = struct.Struct("<QI")
_FOOTER_BYTES = 4
_MASK_DELTA = 0xA282EAD8
_FIX = "Rewrite the file, or pass skip_corrupt=True to tfrecord_dataset to skip the damaged part."


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
        table.append(crc)
    return table


_TABLE = _crc32c_table()


def _masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC-32C (Castagnoli) of ``data``; meant for the 8-byte headers."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def _compressed(start: bytes) -> str:
    """What to do about a file whose first record header is wrong, from its first two bytes:
    a GZIP or ZLIB stream is read with its ``compression_type``; anything else is damaged."""
    if start == b"\x1f\x8b":
        kind = "GZIP"
    elif len(start) == 2 and start[0] == 0x78 and int.from_bytes(start, "big") % 31 == 0:
        kind = "ZLIB"
    else:
        return _FIX
    return f"It starts as a {kind} stream: pass compression_type={kind!r} to read it."


def _scan_headers(path: str) -> int:
    """Counts the records of an uncompressed TFRecord file from their length headers."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return 0
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                offset = count = 0
                while offset < size:
                    if offset + _HEADER.size > size:
                        raise DataError(
                            f"{path}: truncated TFRecord file: record {count} at byte {offset} "
                            f"has {size - offset} of its 12 header bytes. {_FIX}"
                        )
                    length, length_crc = _HEADER.unpack_from(mm, offset)
                    if _masked_crc32c(mm[offset : offset + 8]) != length_crc:
                        fix = _compressed(mm[:2]) if offset == 0 else _FIX
                        raise DataError(
                            f"{path}: corrupt TFRecord file: record {count} at byte {offset} "
                            f"has a bad length checksum. {fix}"
                        )
                    end = offset + _HEADER.size + length + _FOOTER_BYTES
                    if end > size:
                        raise DataError(
                            f"{path}: truncated TFRecord file: record {count} at byte {offset} "
                            f"needs {end - offset} bytes but the file ends after "
                            f"{size - offset}. {_FIX}"
                        )
                    offset = end
                    count += 1
                return count
    except FileNotFoundError:
        raise DataError(
            f"{path}: no such file. Check the path, or that every host sees the same files."
        ) from None
    except IsADirectoryError:
        raise DataError(
            f"{path}: is a directory, not a TFRecord file. Pass the files in "
            "it, e.g. a glob like 'dir/*.tfrecord'."
        ) from None
    except PermissionError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror}). Fix its permissions.") from None
    except OSError as e:  # a path through a file (NotADirectoryError), an I/O error, ...
        raise DataError(
            f"{path}: cannot be read ({e.strerror or e}). Check the path, or that every host "
            "sees the same files."
        ) from None


_readers: dict[tuple, object] = {}


def _reader(compression_type: str | None, skip_corrupt: bool):
    """A ``tf.function`` counting a file's records, traced once per kind (not once per file)."""
    import tensorflow as tf

    key = (compression_type or "", skip_corrupt)
    if key not in _readers:

        @tf.function(input_signature=[tf.TensorSpec([], tf.string)])
        def count(path):
            dataset = tf.data.TFRecordDataset(path, compression_type=key[0], buffer_size=1 << 20)
            if skip_corrupt:
                dataset = dataset.ignore_errors()
            # Batched, so the reducer runs once per thousand records, not once per record.
            return dataset.batch(1024).reduce(
                tf.constant(0, tf.int64), lambda n, batch: n + tf.size(batch, tf.int64)
            )

        _readers[key] = count
    return _readers[key]


def _read_with_tensorflow(
    path: str, compression_type: str | None, skip_corrupt: bool = False
) -> int:
    """Counts the records TensorFlow's reader yields, checking every checksum on the way."""
    import tensorflow as tf

    try:
        return int(_reader(compression_type, skip_corrupt)(tf.constant(path)))
    except (tf.errors.DataLossError, tf.errors.InvalidArgumentError) as e:
        # TensorFlow's message ("corrupted record at 123") does not name the file.
        where = _data_error_text(e.message)
        hint = (
            f", or it is not {compression_type}-compressed (compression_type={compression_type!r})"
            if compression_type
            else ""
        )
        raise DataError(
            f"{path}: corrupt TFRecord file ({where or 'a bad record'}): a record failed its "
            f"checksum or the file is truncated{hint}. {_FIX}"
        ) from None
    except tf.errors.NotFoundError:
        raise DataError(
            f"{path}: no such file. Check the path, or that every host sees the same files."
        ) from None


def _data_error_text(message: str) -> str:
    """What TensorFlow said of the data, without what it says around it: inside a
    ``tf.function`` the message reads ``Graph execution error: ... Detected at node ... (the
    trace) ... corrupted record at 322 [[{{node ...}}]] [Op:...]``; the last line, with the node
    and op names taken out, is the reader's own."""
    text = re.sub(r"\{\{[^}]*\}\}|\[\[.*?\]\]|\[Op:[^\]]*\]", " ", message, flags=re.S)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def count_records(
    path: str | os.PathLike, *, verify: bool = False, compression_type: str | None = None
) -> int:
    """Counts the records of one TFRecord file.

    Uncompressed files are counted from their record headers alone (each header's checksum
    is checked, and a truncated file is detected), without parsing or reading the payloads.

    Args:
        path: The file.
        verify: Also check every record's payload checksum (reads the whole file once).
            Defaults to False.
        compression_type: ``None``, ``""``, ``"GZIP"`` or ``"ZLIB"``. Compressed files are
            always read in full, and so always verified. Defaults to None.

    Returns:
        The number of records.

    Raises:
        DataError: The file is missing, truncated, or has a record whose checksum is wrong
            (payload checksums only with ``verify``). The message names the file.

    Example:
        >>> count_records("data/shard-00000-of-00004.tfrecord")
        1000
    """
    path = os.fspath(path)
    if compression_type:
        if not os.path.isfile(path):
            _scan_headers(path)  # raises the same clear error as for an uncompressed file
        return _read_with_tensorflow(path, compression_type)
    count = _scan_headers(path)
    if verify and count:
        tf_count = _read_with_tensorflow(path, None)
        if tf_count != count:  # cannot happen for a well-formed file; guards the scanner
            raise DataError(
                f"{path}: {count} record headers but TensorFlow reads {tf_count} "
                "records. Rewrite the file."
            )
    return count


def _feature(name: str, value):
    import tensorflow as tf

    if isinstance(value, (bytes, str)):
        items = [value]
    elif isinstance(value, (list, tuple)) and value and isinstance(value[0], (bytes, str)):
        items = list(value)
    elif isinstance(value, np.ndarray) and value.dtype.kind in "SUO":
        items = value.reshape(-1).tolist()
    else:
        items = None
    if items is not None and all(isinstance(v, (bytes, str)) for v in items):
        # Encoded one by one, not through NumPy, which drops trailing zero bytes.
        items = [v.encode() if isinstance(v, str) else v for v in items]
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=items))
    array = np.asarray(value) if items is None else np.asarray(items, dtype=object)
    if array.dtype.kind in "biu":
        return tf.train.Feature(int64_list=tf.train.Int64List(value=array.reshape(-1).tolist()))
    if array.dtype.kind == "f":
        return tf.train.Feature(float_list=tf.train.FloatList(value=array.reshape(-1).tolist()))
    raise DataError(
        f"write_tfrecord_shards: feature {name!r} must be an int, float, bytes, str, or a "
        f"NumPy array or list of those; got {type(value).__name__}"
        f"{f' with dtype {array.dtype}' if isinstance(value, np.ndarray) else ''}. Convert "
        "it first, e.g. with np.asarray(value, np.float32)."
    )


def write_tfrecord_shards(
    examples: Iterable[Mapping], directory: str | os.PathLike, num_shards: int
) -> list[str]:
    """Writes ``tf.train.Example`` records round-robin into ``num_shards`` TFRecord files.

    Not a collective: any subset of ranks may call it (usually rank 0 alone, followed by a
    ``syncdp.barrier()`` before the others read). Each shard is written to a temporary name of
    this call's own and renamed when complete, so a reader never sees a half-written shard,
    and ranks writing the same shards at once each put a whole file in place (the last rename
    wins: write the same examples on every rank that calls it).

    Args:
        examples: Dicts mapping a feature name to an int, float, bytes, str, or a NumPy array
            (flattened) or list of those. Ints and bools become ``int64_list``, floats
            ``float_list``, bytes and str ``bytes_list``.
        directory: Where to write; created if missing.
        num_shards: How many files. Example ``i`` goes to shard ``i % num_shards``.

    Returns:
        The shard paths, ``directory/shard-00000-of-0000N.tfrecord`` onwards, in order.

    Raises:
        ValueError: ``num_shards`` is not a positive integer.
        DataError: A feature value has a type that cannot be stored.

    Example:
        >>> paths = write_tfrecord_shards(
        ...     ({"id": i, "x": np.ones(3, np.float32)} for i in range(100)), "data", 4)
    """
    import tensorflow as tf

    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"write_tfrecord_shards needs num_shards >= 1; got {num_shards!r}.")
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    paths = [
        os.path.join(directory, f"shard-{i:05d}-of-{num_shards:05d}.tfrecord")
        for i in range(num_shards)
    ]
    # A name of this call's own: several ranks (or hosts sharing a directory) may write the same
    # shards at once, and each renames only what it wrote itself.
    tag = f".{os.getpid()}-{secrets.token_hex(4)}.tmp"
    writers = [tf.io.TFRecordWriter(p + tag) for p in paths]
    try:
        for i, example in enumerate(examples):
            features = {str(k): _feature(str(k), v) for k, v in example.items()}
            record = tf.train.Example(features=tf.train.Features(feature=features))
            writers[i % num_shards].write(record.SerializeToString())
    except BaseException:
        for writer, path in zip(writers, paths, strict=True):
            writer.close()
            os.remove(path + tag)
        raise
    for writer, path in zip(writers, paths, strict=True):
        writer.close()
        os.replace(path + tag, path)
    return paths
