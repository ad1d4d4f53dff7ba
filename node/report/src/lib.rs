//! A node's reports to the gateway (placeholder; being written).
