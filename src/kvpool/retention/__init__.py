"""Retention: priorities, pins, TTLs, sessions and tenant quotas (docs/retention.md)."""

from kvpool.retention.book import RetentionBook
from kvpool.retention.policy import RetainingPolicy
from kvpool.retention.quotas import TenantQuotas
from kvpool.retention.spec import DEFAULT, MAPPING_KEYS, Priority, Retention

__all__ = ["DEFAULT", "MAPPING_KEYS", "Priority", "RetainingPolicy", "Retention",
           "RetentionBook", "TenantQuotas"]
