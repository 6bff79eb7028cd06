"""What keeps a LightningModule unchanged while its step runs many times (once per micro-batch and stage): the
step's random draws made alike everywhere (``draws``), torchmetrics states set aside and put back
(``metric_states``), the lists a step appends to (``module_lists``), and batches taken apart and put together as
pytrees whatever their container (``pytree``)."""
