"""The blob bucket's lifecycle rule (SPEC §7.3), accepted by a (moto) S3 API."""

from __future__ import annotations

import json

from tests.deploy.manifests import DEPLOY


def test_bucket_lifecycle_rule_aborts_incomplete_multipart_uploads() -> None:
    """SPEC §7.3: incomplete multipart uploads (a scratch bank cut short) are aborted by a
    bucket rule. The documented JSON is accepted by the S3 API (moto's, here)."""
    import boto3
    from moto import mock_aws

    config = json.loads((DEPLOY / "s3" / "lifecycle.json").read_text())
    with mock_aws():
        s3 = boto3.client(
            "s3",
            region_name="us-east-1",
            aws_access_key_id="test",
            aws_secret_access_key="test",
        )
        s3.create_bucket(Bucket="runfleet-lifecycle-check")
        s3.put_bucket_lifecycle_configuration(
            Bucket="runfleet-lifecycle-check", LifecycleConfiguration=config
        )
        rules = s3.get_bucket_lifecycle_configuration(Bucket="runfleet-lifecycle-check")["Rules"]
    (rule,) = rules
    assert rule["Status"] == "Enabled"
    assert rule["AbortIncompleteMultipartUpload"]["DaysAfterInitiation"] >= 1
    assert "lifecycle.json" in (DEPLOY / "README.md").read_text()
