"""Pipeline parallelism: stage plans and schedules (``pipeline``, ``pipeline_hf``), the live pipeline
(``pipeline_live``), the schedule's timeline (``schedule_recorder``), all plain torch; and its technique object with
its cost account (``pipeline_parallel``) and the LightningModule adapter it installs (``pipeline_adapter``)."""
