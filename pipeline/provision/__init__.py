"""Provisioning GPU hosts: the Ansible playbook run through ansible-runner, and the testinfra proof."""

from pipeline.provision.runner import (
    Failure,
    HostTally,
    ProvisionError,
    ProvisionResult,
    host_inventory,
    provision,
)

__all__ = ["Failure", "HostTally", "ProvisionError", "ProvisionResult", "host_inventory", "provision"]
