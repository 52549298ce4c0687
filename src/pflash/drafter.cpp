// PFlash drafter (see drafter.h): the engine's token scorer and the model's tokenizer.
#include "pflash/drafter.h"

namespace fathom::pflash {

std::unique_ptr<drafter> drafter::load(const std::string &path, int n_threads, int32_t n_batch,
                                       const std::string &device) {
    std::unique_ptr<drafter> d(new drafter());
    d->scorer_ = token_scorer::load(path, n_threads, n_batch, device);  // checks the architecture
    d->file_ = gguf::file::open(path);
    d->tok_ = std::make_unique<tokenizer>(*d->file_);
    return d;
}

}  // namespace fathom::pflash
