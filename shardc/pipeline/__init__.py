"""Pipeline parallelism as a sharded stage dim (GSPMD §3.3): the value (`Pipeline`), the stage shift
primitive, the pipelined loop and the trace that puts it in place of a layer stack. See docs/pipeline.md."""
from shardc.pipeline.value import SCHEDULES, Pipeline
from shardc.pipeline.shift import stage_shift, stage_shift_p
from shardc.pipeline.loop import pipelined_scan
from shardc.pipeline.stacks import PipelineNotApplied, Stack, find_stacks, largest, pipelining

__all__ = ["Pipeline", "SCHEDULES", "stage_shift", "stage_shift_p", "pipelined_scan", "Stack", "find_stacks",
           "largest", "pipelining", "PipelineNotApplied"]
