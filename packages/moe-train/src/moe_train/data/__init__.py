from moe_train.data.corpus import Documents, stdlib_documents, text_file_documents
from moe_train.data.prepare import prepare_data
from moe_train.data.sampler import WindowSampler, eval_windows
from moe_train.data.token_file import DataError, TokenSplit, open_data
from moe_train.data.tokenizer import train_bpe

__all__ = ["prepare_data", "train_bpe", "open_data", "DataError", "TokenSplit", "WindowSampler", "eval_windows",
           "Documents", "stdlib_documents", "text_file_documents"]
