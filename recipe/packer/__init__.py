"""The packer: dump directory -> validated, compressed, durable shard records. Runs beside the backend.

Per sample, in stages:
  scan      (packer thread)  find the raw pieces of each announced request; hand it on once the pieces
                             cover the whole prompt [0, n) *and* the server has answered
  assemble  (worker process) the pieces' headers and token ids, in prompt order
  validate  (worker)         token ids equal what was sent
  encode    (worker)         the byte planes (split on the GPU) stream block by block from the pieces
                             into the record: the high plane through zstd, the low plane raw
                             (recipe.shards.codec); each block is checked for NaN/Inf and all-zero
                             slots on the way, and a refused sample's bytes are cut off the shard again
  append    (worker)         the record goes to the end of the worker's own shard file and is flushed
                             to the disk (the workers in parallel, keeping the disk busy)
  commit    (committer thread) fsync those shards, then append and fsync the index lines; only then
                             are the sample's raw pieces deleted. Its own thread: dispatching goes on
                             while the disk syncs
Modules: scheduler (the packer thread, `Packer`), books (what is pending, what failed), pool (the
worker processes), worker (their stages), checks, committer, progress, messages (what crosses
between the thread and the processes).
Workers are processes that own their shard files: compression scales with cores (no GIL), and only
small records cross between processes. A request that answered but whose dump never completes within
`dump_timeout_s` is a failed sample: this is what catches a CUDA-graph replay (Python hooks do not
run) or a mis-set server flag.
"""

from .checks import PlaneCheck, check_planes, validate
from .progress import Progress
from .scheduler import Packer
from .worker import ShardAppender, assemble, pack, planes

__all__ = ["Packer", "Progress", "PlaneCheck", "ShardAppender", "assemble", "check_planes", "pack", "planes"]
__all__ += ["validate"]
