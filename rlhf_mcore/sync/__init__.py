"""Weight sync ("checkpoint engine"): the actor's new weights into the rollout engine after every update.

The training side exports full Hugging Face-named tensors (`models.export_hf_weights`, a collective that
undoes TP/PP sharding); the sync moves them in buckets of a configurable size to the rollout side, whose
engine takes its own tensor-parallel slice. Pieces:

  buckets.py    grouping by bytes; flat uint8 buffers + (name, dtype, shape, offset) metadata; a packer
                that reuses one buffer, so a sync holds about one bucket
  transport.py  the sender/receiver interface; the in-process (colocated, zero-copy) transport
  ipc.py        CUDA IPC / shared memory to another process (torch.multiprocessing reductions)
  broadcast.py  a broadcast from a source rank to rollout ranks (a torch.distributed group or a cross-pool Link)
  verify.py     exact checksums; transport and engine verification (`WeightSyncError` names the tensor)
  readback.py   a rollout engine's weights in HF layout (native and HF engines; `hf_weight_shards()`)
  memory.py     live / peak bytes held by the sync
  metrics.py    `SyncStats` -> `sync/*` metrics
  colocated.py  `sync_actor_to_rollout`, what the trainer calls
"""
from .broadcast import BroadcastReceiver, BroadcastSender, GroupComm, StagedReceive, broadcast_weights, receive_weights
from .buckets import BucketPacker, FlatBucket, TensorMeta, bucket_bytes_from_mb, group_by_bytes
from .colocated import sync_actor_to_rollout
from .ipc import IpcChannel, IpcReceiver, IpcSender, deserialize_bucket, serialize_bucket
from .memory import MemoryTracker
from .metrics import SyncStats
from .readback import HeldShard, engine_hf_shards
from .transport import InProcessChannel, WeightReceiver, WeightSender, load_buckets_into
from .verify import ChecksumTap, EngineVerifier, WeightSyncError, checksum, compare_checksums

__all__ = ["BroadcastReceiver", "BroadcastSender", "BucketPacker", "ChecksumTap", "EngineVerifier", "FlatBucket",
           "GroupComm", "HeldShard", "InProcessChannel", "IpcChannel", "IpcReceiver", "IpcSender", "MemoryTracker",
           "StagedReceive", "SyncStats", "TensorMeta", "WeightReceiver", "WeightSender", "WeightSyncError",
           "broadcast_weights", "bucket_bytes_from_mb", "checksum", "compare_checksums", "deserialize_bucket",
           "engine_hf_shards", "group_by_bytes", "load_buckets_into", "receive_weights", "serialize_bucket",
           "sync_actor_to_rollout"]
