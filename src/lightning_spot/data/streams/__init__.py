"""Streams (``IterableDataset``) as training data, resumed exactly on any layout.

    loader = stream_dataloader(loader, dp_rank=1, dp_size=2, divisor=4, progress=lambda: batches_trained)

Mode "global stream" (the default): every data-parallel replica reads the same unsharded stream in
global batches (the user's DataLoader ``batch_size``) and keeps its share of each, with the same slice arithmetic
as map-style data (``lightning_spot.data.sharded``). The stream's state does not depend on the layout, so a resume onto
any P x D continues at the right sample. The price: every replica reads the whole stream (D times the reading
of one; in every mode only a pipeline's first stage reads, ``stage_feed`` sends the batches to the others).

Mode "sharded" (a LitData ``StreamingDataset``, ``litdata_shards``): each replica reads only its own shard, LitData
being told the replica index and D; resumes go through LitData's elastic path, so global batch k is the same set of
samples on any layout and worker count.

Mode "fixed layout" (per-replica streams: torchdata's ``StatefulDataLoader``, a Hugging Face dataset split by
node, or a loader marked with ``fixed_layout``): each replica's loader yields its own local batches and keeps its own
position; a resume needs the same D and worker count (an error says so and names the modes that allow a change).

The contract of the global-stream mode (checked at setup, ``contract``): the dataset is stateful, ``state_dict()`` / ``load_state_dict()``
returning and taking its position, and iterating it continues from that position; with ``num_workers > 0`` that
state lives in the worker processes, so a plain DataLoader must use ``num_workers=0``.
"""

from lightning_spot.data.streams.contract import check_stream, is_stream
from lightning_spot.data.streams.fixed_layout import FixedLayoutLoader, fixed_layout, is_fixed_layout
from lightning_spot.data.streams.global_stream import GlobalStreamLoader
from lightning_spot.data.streams.litdata_shards import LITDATA_VERSION, ShardedStreamLoader, is_litdata
from lightning_spot.data.streams.modes import peek_batch, stream_dataloader
from lightning_spot.data.streams.stage_feed import StageFeed, stage_feed

__all__ = [
    "LITDATA_VERSION",
    "FixedLayoutLoader",
    "GlobalStreamLoader",
    "ShardedStreamLoader",
    "StageFeed",
    "check_stream",
    "fixed_layout",
    "is_fixed_layout",
    "is_litdata",
    "is_stream",
    "peek_batch",
    "stage_feed",
    "stream_dataloader",
]
