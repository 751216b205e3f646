// Compilation unit: the attention kernels over model-dtype and int8 pages (these sources share static helpers).
#include "kernels.h"
#include "paged_decode.cpp"
#include "paged_prefill.cpp"
#include "paged_prefill_entry.cpp"
#include "kv_int8.cpp"
#include "paged_decode_int8.cpp"
