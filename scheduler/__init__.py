"""pagedserve's scheduler: requests, the paged KV block pool, the prefix cache and the
continuous-batching scheduler, plus the wire types of the step plan and step result.

Pure Python (no torch, no ray), so it is unit-tested alone and imported by workers
for the wire types only.
"""

from pagedserve.scheduler.kv.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from pagedserve.scheduler.config import CacheConfig, SchedulerConfig
from pagedserve.scheduler.kv.kv_cache_manager import KVCacheManager
from pagedserve.scheduler.outputs import (CachedRequestData, EngineCoreOutput, Logprobs, ModelRunnerOutput,
                               NewRequestData, SchedulerOutput)
from pagedserve.scheduler.request import FinishReason, Request, RequestStatus
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import QueueFullError, Scheduler
from pagedserve.scheduler.stats import SchedulerStats

__all__ = [
    "BlockPool", "CacheConfig", "CachedRequestData", "EngineCoreOutput", "FinishReason",
    "FreeKVCacheBlockQueue", "KVCacheBlock", "KVCacheManager", "Logprobs", "ModelRunnerOutput",
    "NewRequestData", "QueueFullError", "Request", "RequestStatus", "SamplingParams", "Scheduler",
    "SchedulerConfig", "SchedulerOutput", "SchedulerStats",
]
