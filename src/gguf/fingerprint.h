// A GGUF file's fingerprint: the model identity of saved session states (the prompt cache,
// docs/prompt-cache.md), i.e. which model file a state was computed with. Engines build their
// engine::state_identity() from it plus the options that change the saved bytes.
#pragma once
#include <string>

namespace fathom::gguf {

class file;

// "<file bytes>-<16 hex digits>": the size, and XXH64 over the GGUF header (magic, metadata and tensor
// directory: every byte before the tensor data) followed by 64 samples of 4 KiB spread evenly over the
// tensor data (first and last included). The header pins the architecture, hyper-parameters,
// tokenizer and tensor types and offsets; the samples tell apart files that share a header (a fine-tune
// saved with the same metadata). Cost: the header plus 256 KiB of reads, whatever the file's size.
std::string file_fingerprint(const gguf::file &f);

}  // namespace fathom::gguf
