"""Provisioning GPU hosts: the Ansible playbook run through ansible-runner, and the testinfra proof."""

from pipeline.provision.errors import ProvisionError
from pipeline.provision.runner import (
    Failure,
    HostTally,
    ProvisionResult,
    host_inventory,
    provision,
)

__all__ = ["Failure", "HostTally", "ProvisionError", "ProvisionResult", "host_inventory", "provision"]
