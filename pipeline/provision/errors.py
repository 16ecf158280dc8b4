"""The one error provisioning raises before Ansible runs."""


class ProvisionError(Exception):
    """A problem found before Ansible runs (bad arguments, missing files, a bad inventory)."""
