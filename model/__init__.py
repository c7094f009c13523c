"""clover_batch.model"""
