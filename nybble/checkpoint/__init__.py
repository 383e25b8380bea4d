"""``nybble.save`` / ``nybble.load``: a params pytree with ``QuantizedWeight`` leaves in one safetensors file.

File layout: standard safetensors (8-byte little-endian header size, JSON header, tensor bytes), readable
by any safetensors reader. The header's ``__metadata__`` holds:

* ``format``: ``"nybble"``; ``format_version``: ``"1"``;
* ``tree``: JSON list, one entry per leaf in pytree order: ``path`` (list of ``[kind, key]``, kind
  ``"d"`` dict key, ``"l"`` list or tuple index), ``kind`` (``"array"`` or ``"quantized"``),
  the tensor name(s), and for quantized leaves ``layout``, ``group_size``, ``symmetric``, ``shape``;
* ``info`` (optional): JSON object of facts about the file, e.g. the quantization method (``save_model``);
* ``sha256``: hex digest over the tree, the info, and every tensor's name, dtype, shape and bytes, in
  header order.

Loading refuses (``ValueError``) a truncated or tampered file, a foreign or newer format version and an
unknown layout, so a damaged file never becomes a silently wrong model. Writes are atomic: a temporary
file in the target directory, fsync, then ``os.replace``; the file gets the mode the umask gives a new
file (0644 under the usual 022), as ``open`` would.

Modules: ``format`` (constants, names, the checksum), ``header`` (the one validated header), ``reader``
(whole-file or positioned reads), ``loader`` (one loader, local or placed on a mesh), ``writer`` (save).
"""

from nybble.checkpoint.format import FORMAT_NAME, FORMAT_VERSION
from nybble.checkpoint.header import Header
from nybble.checkpoint.loader import CheckpointLeaf, Placement, load, read_header_of, read_metadata
from nybble.checkpoint.writer import save

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "CheckpointLeaf",
    "Header",
    "Placement",
    "load",
    "read_header_of",
    "read_metadata",
    "save",
]
