"""clover_batch.pipeline"""
