"""Streams (``IterableDataset``) as training data, resumed exactly on any layout.

    loader = stream_dataloader(loader, dp_rank=1, dp_size=2, divisor=4, progress=lambda: batches_trained)

Mode "global stream" (the one built so far): every data-parallel replica reads the same unsharded stream in
global batches (the user's DataLoader ``batch_size``) and keeps its share of each, with the same slice arithmetic
as map-style data (``lightning_spot.data``). The stream's state does not depend on the layout, so a resume onto
any P x D continues at the right sample. The price: every replica reads the whole stream (D times the reading
of one), and every stage of a replica reads it too.

The contract (checked at setup, ``contract``): the dataset is stateful, ``state_dict()`` / ``load_state_dict()``
returning and taking its position, and iterating it continues from that position; with ``num_workers > 0`` that
state lives in the worker processes, so a plain DataLoader must use ``num_workers=0``.
"""

from lightning_spot.streaming.contract import check_stream, is_stream
from lightning_spot.streaming.global_stream import GlobalStreamLoader, peek_batch, stream_dataloader

__all__ = ["GlobalStreamLoader", "check_stream", "is_stream", "peek_batch", "stream_dataloader"]
