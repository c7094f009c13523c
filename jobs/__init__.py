"""clover_batch.jobs"""
