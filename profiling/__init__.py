"""Trace hooks: NVTX ranges for Nsight, and the prepared GPU check."""
