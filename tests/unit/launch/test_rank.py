"""A rank's process group: which backend carries which device's tensors."""

from omegaconf import OmegaConf
from torch.distributed.distributed_c10d import BackendConfig

from sharded_exp.launch.rank import process_group_backend


def test_a_gpu_rank_that_offloads_reduces_host_tensors_over_gloo():
    """Offloaded gradients are host DTensors: clipping them reduces over the mesh on the CPU,
    which NCCL cannot; torchtitan pairs the two backends the same way."""
    offloaded = OmegaConf.create({"name": "fsdp", "cpu_offload": True})
    assert process_group_backend("cpu", OmegaConf.create({"name": "ddp"})) == "gloo"
    assert process_group_backend("cuda", OmegaConf.create({"name": "ddp"})) == "nccl"
    assert process_group_backend("cuda", OmegaConf.create({"name": "fsdp", "cpu_offload": False})) == "nccl"
    assert process_group_backend("cuda", offloaded) == "cuda:nccl,cpu:gloo"
    # torch reads the pair as one backend per device type
    assert BackendConfig("cuda:nccl,cpu:gloo").get_device_backend_map() == {"cuda": "nccl", "cpu": "gloo"}
