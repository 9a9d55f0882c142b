"""The moto server's dummy credentials as s3fs options, for benchmark child processes."""

from s3server import CREDS


def options(endpoint: str) -> dict:
    return {"endpoint_url": endpoint, **CREDS, "skip_instance_cache": True}
