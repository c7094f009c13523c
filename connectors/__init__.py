"""clover_batch.connectors"""
