// safetensors writer (see safetensors_writer.h). The byte layout matches the
// Python library so a file written here is byte-identical to save_file().
#include "io/safetensors_writer.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/half.h"
#include "io/file_write.h"

namespace loom::safetensors {
namespace {

bool writable(StDType t) { return t == StDType::f32 || t == StDType::f16 || t == StDType::bf16; }
// add_raw also takes the integer types quantized checkpoints store (codes, zero points, shapes).
bool writable_raw(StDType t) {
  return writable(t) || t == StDType::i8 || t == StDType::u8 || t == StDType::i32 || t == StDType::i64 ||
         t == StDType::f8_e4m3;
}

// Rank in the reference library's dtype enum (its sort key, largest first).
int reference_rank(StDType t) {
  switch (t) {
    case StDType::f16: return 0;
    case StDType::bf16: return 1;
    default: return 2;
  }
}

}  // namespace

Writer::Writer(std::string path) : path_(std::move(path)) {}

void Writer::check_new(const std::string& name, StDType dtype, const std::vector<int64_t>& shape,
                       size_t n_bytes, bool raw) const {
  if (name.empty() || name == "__metadata__")
    fail(ErrorKind::invalid_input, "{}: invalid tensor name '{}'", path_, name);
  if (!(raw ? writable_raw(dtype) : writable(dtype)))
    fail(ErrorKind::unsupported, "{}: tensor '{}': cannot write dtype {} (only F32, F16, BF16{})", path_,
         name, st_dtype_name(dtype), raw ? ", I8, U8, I32, I64, F8_E4M3" : "");
  for (const auto& e : tensors_)
    if (e.name == name) fail(ErrorKind::invalid_input, "{}: duplicate tensor '{}'", path_, name);
  uint64_t numel = 1;
  for (int64_t d : shape) {
    if (d < 0) fail(ErrorKind::invalid_input, "{}: tensor '{}': negative dimension {}", path_, name, d);
    numel *= static_cast<uint64_t>(d);
  }
  if (numel * st_dtype_size(dtype) != n_bytes)
    fail(ErrorKind::invalid_input, "{}: tensor '{}': shape holds {} elements of {} but {} bytes were given", path_,
         name, numel, st_dtype_name(dtype), n_bytes);
}

void Writer::add(std::string name, std::span<const float> values, std::vector<int64_t> shape, StDType dtype) {
  const size_t esize = writable(dtype) ? st_dtype_size(dtype) : 0;
  check_new(name, dtype, shape, values.size() * esize, false);
  std::string bytes(values.size() * esize, '\0');
  if (dtype == StDType::f32) {
    if (!values.empty()) std::memcpy(bytes.data(), values.data(), bytes.size());
  } else {
    for (size_t i = 0; i < values.size(); ++i) {
      const uint16_t h = dtype == StDType::f16 ? fp32_to_fp16(values[i]) : fp32_to_bf16(values[i]);
      std::memcpy(bytes.data() + 2 * i, &h, 2);
    }
  }
  tensors_.push_back({std::move(name), dtype, std::move(shape), std::move(bytes)});
}

void Writer::add_raw(std::string name, StDType dtype, std::vector<int64_t> shape, std::string_view bytes) {
  check_new(name, dtype, shape, bytes.size(), true);
  tensors_.push_back({std::move(name), dtype, std::move(shape), std::string(bytes)});
}

void Writer::set_metadata(std::string key, std::string value) { metadata_[std::move(key)] = std::move(value); }

std::string Writer::serialize(WriteOrder order) const {
  std::vector<size_t> idx(tensors_.size());
  std::iota(idx.begin(), idx.end(), size_t{0});
  if (order == WriteOrder::reference)
    std::stable_sort(idx.begin(), idx.end(), [&](size_t a, size_t b) {
      const auto& x = tensors_[a];
      const auto& y = tensors_[b];
      const int rx = reference_rank(x.dtype), ry = reference_rank(y.dtype);
      return rx != ry ? rx > ry : x.name < y.name;
    });
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata_.empty()) {
    nlohmann::ordered_json md = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata_) md[k] = v;
    header["__metadata__"] = std::move(md);
  }
  uint64_t offset = 0;
  for (size_t i : idx) {
    const auto& e = tensors_[i];
    nlohmann::ordered_json t = nlohmann::ordered_json::object();
    t["dtype"] = st_dtype_name(e.dtype);
    t["shape"] = e.shape;
    t["data_offsets"] = {offset, offset + e.bytes.size()};
    header[e.name] = std::move(t);
    offset += e.bytes.size();
  }
  std::string json = header.dump();
  json.append((8 - json.size() % 8) % 8, ' ');  // data starts 8-byte aligned
  std::string out(8, '\0');
  const uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  out.reserve(8 + json.size() + offset);
  out += json;
  for (size_t i : idx) out += tensors_[i].bytes;
  return out;
}

void Writer::write(WriteOrder order) const { write_file_atomic(path_, serialize(order)); }

}  // namespace loom::safetensors
