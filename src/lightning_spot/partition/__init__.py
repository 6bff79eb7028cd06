"""Split a LightningModule into pipeline stages: find its layer sequence (``discovery``), cut it
(``cuts``, ``balance``), keep only this rank's stages (``placement``) and run a stage of the user's
unchanged step function (``stage_run``, ``loss_hook``)."""
