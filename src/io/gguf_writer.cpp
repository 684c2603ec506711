#include "io/gguf_writer.h"

#include <algorithm>

#include "core/error.h"
#include "io/file_write.h"

namespace loom::gguf {
namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" little-endian
constexpr uint32_t kVersion = 3;

template <typename T>
void put(AtomicFileWriter& w, T v) {
  w.write(&v, sizeof v);
}

void put_string(AtomicFileWriter& w, std::string_view s) {
  put<uint64_t>(w, s.size());
  w.write(s);
}

void put_value(AtomicFileWriter& w, const Value& v);

void put_payload(AtomicFileWriter& w, const Value& v) {
  switch (v.type) {
    case ValueType::u8: put<uint8_t>(w, static_cast<uint8_t>(std::get<uint64_t>(v.v))); return;
    case ValueType::u16: put<uint16_t>(w, static_cast<uint16_t>(std::get<uint64_t>(v.v))); return;
    case ValueType::u32: put<uint32_t>(w, static_cast<uint32_t>(std::get<uint64_t>(v.v))); return;
    case ValueType::u64: put<uint64_t>(w, std::get<uint64_t>(v.v)); return;
    case ValueType::i8: put<int8_t>(w, static_cast<int8_t>(std::get<int64_t>(v.v))); return;
    case ValueType::i16: put<int16_t>(w, static_cast<int16_t>(std::get<int64_t>(v.v))); return;
    case ValueType::i32: put<int32_t>(w, static_cast<int32_t>(std::get<int64_t>(v.v))); return;
    case ValueType::i64: put<int64_t>(w, std::get<int64_t>(v.v)); return;
    case ValueType::f32: put<float>(w, static_cast<float>(std::get<double>(v.v))); return;
    case ValueType::f64: put<double>(w, std::get<double>(v.v)); return;
    case ValueType::boolean: put<uint8_t>(w, std::get<bool>(v.v) ? 1 : 0); return;
    case ValueType::string: put_string(w, std::get<std::string>(v.v)); return;
    case ValueType::array: {
      const Array& a = std::get<Array>(v.v);
      put<uint32_t>(w, static_cast<uint32_t>(a.element_type));
      put<uint64_t>(w, a.items.size());
      for (const Value& item : a.items) put_payload(w, item);
      return;
    }
  }
  LOOM_ASSERT(false && "put_payload: unknown value type");
}

void put_value(AtomicFileWriter& w, const Value& v) {
  put<uint32_t>(w, static_cast<uint32_t>(v.type));
  put_payload(w, v);
}

uint64_t align_up(uint64_t n, uint64_t a) { return (n + a - 1) / a * a; }

}  // namespace

void Writer::set(std::string key, Value value) {
  if (key == "general.alignment") {
    const uint64_t a = value.type == ValueType::u32 ? std::get<uint64_t>(value.v) : 0;
    if (a == 0 || (a & (a - 1)) != 0)
      fail(ErrorKind::invalid_input, "general.alignment must be a u32 power of two");
    if (!tensors_.empty()) fail(ErrorKind::invalid_input, "general.alignment must be set before any tensor");
    alignment_ = a;
  }
  for (auto& [k, v] : kv_)
    if (k == key) {
      v = std::move(value);
      return;
    }
  kv_.emplace_back(std::move(key), std::move(value));
}

void Writer::set_string(std::string key, std::string v) { set(std::move(key), {ValueType::string, std::move(v)}); }
void Writer::set_u32(std::string key, uint32_t v) { set(std::move(key), {ValueType::u32, uint64_t{v}}); }
void Writer::set_i32(std::string key, int32_t v) { set(std::move(key), {ValueType::i32, int64_t{v}}); }
void Writer::set_f32(std::string key, float v) { set(std::move(key), {ValueType::f32, double{v}}); }
void Writer::set_bool(std::string key, bool v) { set(std::move(key), {ValueType::boolean, v}); }

void Writer::set_string_array(std::string key, const std::vector<std::string>& v) {
  Array a;
  a.element_type = ValueType::string;
  a.items.reserve(v.size());
  for (const auto& s : v) a.items.push_back({ValueType::string, s});
  set(std::move(key), {ValueType::array, std::move(a)});
}

void Writer::erase(std::string_view key) {
  std::erase_if(kv_, [&](const auto& kv) { return kv.first == key; });
}

const Value* Writer::find(std::string_view key) const {
  for (const auto& [k, v] : kv_)
    if (k == key) return &v;
  return nullptr;
}

void Writer::add_tensor(std::string name, DType dtype, std::vector<int64_t> shape, Fill fill) {
  if (name.empty()) fail(ErrorKind::invalid_input, "a GGUF tensor needs a name");
  if (!dtype_traits_of_id(static_cast<uint32_t>(dtype)))  // loom's own types (nf4, i8_ch) have no ggml id
    fail(ErrorKind::invalid_input, "tensor '{}': {} is not a GGUF tensor type", name, dtype_name(dtype));
  for (const auto& t : tensors_)
    if (t.name == name) fail(ErrorKind::invalid_input, "tensor '{}' is added twice", name);
  if (shape.empty() || shape.size() > 4)
    fail(ErrorKind::invalid_input, "tensor '{}': {} dimensions (GGUF takes 1 to 4)", name, shape.size());
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < shape.size(); ++i) rows *= shape[i];
  const int64_t cols = shape.back();
  if (rows <= 0 || cols <= 0 || cols % dtype_block_size(dtype) != 0)
    fail(ErrorKind::invalid_input, "tensor '{}': rows of {} elements do not fit {} blocks of {}", name, cols,
         dtype_name(dtype), dtype_block_size(dtype));
  const size_t nbytes = static_cast<size_t>(rows) * dtype_row_bytes(dtype, cols);
  tensors_.push_back({std::move(name), dtype, std::move(shape), nbytes, next_offset_, std::move(fill)});
  next_offset_ = align_up(next_offset_ + nbytes, alignment_);
}

uint64_t Writer::data_bytes() const { return next_offset_; }

void Writer::write(const std::string& path) const {
  AtomicFileWriter w(path);
  put<uint32_t>(w, kMagic);
  put<uint32_t>(w, kVersion);
  put<uint64_t>(w, tensors_.size());
  put<uint64_t>(w, kv_.size());
  for (const auto& [k, v] : kv_) {
    put_string(w, k);
    put_value(w, v);
  }
  for (const Tensor& t : tensors_) {
    put_string(w, t.name);
    put<uint32_t>(w, static_cast<uint32_t>(t.shape.size()));
    for (auto it = t.shape.rbegin(); it != t.shape.rend(); ++it) put<uint64_t>(w, static_cast<uint64_t>(*it));
    put<uint32_t>(w, static_cast<uint32_t>(t.dtype));
    put<uint64_t>(w, t.offset);
  }
  w.pad_to(alignment_);
  const uint64_t data_start = w.size();
  std::vector<uint8_t> buf;
  for (const Tensor& t : tensors_) {
    LOOM_ASSERT(w.size() == data_start + t.offset);
    buf.assign(t.nbytes, 0);
    t.fill(buf.data());
    w.write(buf.data(), buf.size());
    w.pad_to(alignment_);
  }
  w.commit();
}

void copy_metadata(const File& src, Writer& w) {
  for (const auto& [k, v] : src.metadata()) w.set(k, v);
}

}  // namespace loom::gguf
