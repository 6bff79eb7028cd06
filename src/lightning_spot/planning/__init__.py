"""Choose a layout: profile the layers (``profile``), measure the machine (``hardware``), predict
step time and memory (``cost_model``) and decide when the job starts (``choose``)."""
