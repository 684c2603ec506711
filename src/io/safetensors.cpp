// safetensors parsing: 8-byte little-endian header length, a JSON header, then
// the raw tensor bytes. Validation order follows the file: length, JSON,
// entries, then the byte ranges as a whole (bounds and overlaps).
#include "io/safetensors.h"

#include <algorithm>
#include <cstring>
#include <set>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace loom::safetensors {
namespace {

using json = nlohmann::json;

struct DTypeRow {
  StDType type;
  const char* name;
  size_t size;
  std::optional<DType> loom;
};

constexpr DTypeRow kDTypes[] = {
    {StDType::boolean, "BOOL", 1, std::nullopt},  {StDType::u8, "U8", 1, std::nullopt},
    {StDType::i8, "I8", 1, DType::i8},            {StDType::f8_e4m3, "F8_E4M3", 1, std::nullopt},
    {StDType::f8_e5m2, "F8_E5M2", 1, std::nullopt}, {StDType::f8_e8m0, "F8_E8M0", 1, std::nullopt},
    {StDType::i16, "I16", 2, DType::i16},         {StDType::u16, "U16", 2, std::nullopt},
    {StDType::f16, "F16", 2, DType::f16},         {StDType::bf16, "BF16", 2, DType::bf16},
    {StDType::i32, "I32", 4, DType::i32},         {StDType::u32, "U32", 4, std::nullopt},
    {StDType::f32, "F32", 4, DType::f32},         {StDType::i64, "I64", 8, DType::i64},
    {StDType::u64, "U64", 8, std::nullopt},       {StDType::f64, "F64", 8, DType::f64},
};

const DTypeRow& row_of(StDType t) {
  for (const auto& r : kDTypes)
    if (r.type == t) return r;
  LOOM_ASSERT(false && "unknown safetensors dtype");
  return kDTypes[0];
}

// nlohmann keeps one value per duplicated key without telling us; a header
// that names a tensor (or a field) twice is ambiguous, so reject it.
json parse_header_json(const uint8_t* p, size_t n, const std::string& file) {
  std::vector<std::set<std::string>> keys_per_object;
  std::string duplicate;
  auto cb = [&](int /*depth*/, json::parse_event_t ev, json& parsed) {
    switch (ev) {
      case json::parse_event_t::object_start: keys_per_object.emplace_back(); break;
      case json::parse_event_t::object_end:
        if (!keys_per_object.empty()) keys_per_object.pop_back();
        break;
      case json::parse_event_t::key:
        if (!keys_per_object.empty() && parsed.is_string() &&
            !keys_per_object.back().insert(parsed.get_ref<const std::string&>()).second &&
            duplicate.empty())
          duplicate = parsed.get<std::string>();
        break;
      default: break;
    }
    return true;
  };
  json j;
  try {
    j = json::parse(p, p + n, cb, /*allow_exceptions=*/true);
  } catch (const json::parse_error& e) {
    // e.byte counts from 1 within the header; report a file offset.
    fail(ErrorKind::invalid_input, "{}: header is not valid JSON (file byte {}): {}", file,
         8 + (e.byte > 0 ? e.byte - 1 : 0), e.what());
  } catch (const json::exception& e) {  // e.g. a number literal overflowing double
    fail(ErrorKind::invalid_input, "{}: header is not valid JSON: {}", file, e.what());
  }
  if (!duplicate.empty())
    fail(ErrorKind::invalid_input, "{}: header has the key '{}' more than once", file, duplicate);
  return j;
}

// A JSON integer that fits in [0, INT64_MAX], or an error naming the field.
uint64_t json_index(const json& v, const std::string& file, const std::string& tensor, const char* field) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(INT64_MAX))
      fail(ErrorKind::invalid_input, "{}: tensor '{}': {} value {} is too large", file, tensor, field, u);
    return u;
  }
  if (v.is_number_integer())  // signed and therefore negative (parser uses unsigned otherwise)
    fail(ErrorKind::invalid_input, "{}: tensor '{}': {} value {} is negative", file, tensor, field,
         v.get<int64_t>());
  fail(ErrorKind::invalid_input, "{}: tensor '{}': {} must hold integers, found {}", file, tensor, field,
       v.type_name());
}

}  // namespace

const char* st_dtype_name(StDType t) { return row_of(t).name; }
size_t st_dtype_size(StDType t) { return row_of(t).size; }
std::optional<DType> to_loom_dtype(StDType t) { return row_of(t).loom; }

std::optional<StDType> st_dtype_from_name(std::string_view name) {
  for (const auto& r : kDTypes)
    if (name == r.name) return r.type;
  return std::nullopt;
}

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[static_cast<size_t>(i)];
  return n;
}

std::string TensorInfo::shape_string() const {
  std::string s = "[";
  for (int i = 0; i < ndim; ++i) s += fmt::format("{}{}", i ? ", " : "", shape[static_cast<size_t>(i)]);
  return s + "]";
}

Tensor TensorInfo::view(std::string_view file) const {
  const auto dt = to_loom_dtype(st_dtype);
  if (!dt)
    fail(ErrorKind::unsupported, "{}: tensor '{}': dtype {} is not supported", file, name,
         st_dtype_name(st_dtype));
  Tensor t;
  // Views are typed `void*` for all callers; the mapping itself is read-only.
  t.data = const_cast<uint8_t*>(data);
  t.dtype = *dt;
  t.ndim = ndim;
  t.shape = shape;
  return t;
}

Tensor TensorInfo::weight_view(std::string_view file) const {
  if (st_dtype != StDType::f32 && st_dtype != StDType::f16 && st_dtype != StDType::bf16)
    fail(ErrorKind::unsupported, "{}: tensor '{}': dtype {} is not supported for weights (F32, F16, BF16 are)",
         file, name, st_dtype_name(st_dtype));
  return view(file);
}

std::unique_ptr<File> File::open(const std::string& path) {
  std::unique_ptr<File> f(new File());
  f->mapping_ = std::make_unique<MappedFile>(path);
  f->data_ = f->mapping_->data();
  f->size_ = f->mapping_->size();
  f->name_ = path;
  f->parse_all();
  return f;
}

std::unique_ptr<File> File::parse(const uint8_t* data, size_t size, const std::string& name) {
  std::unique_ptr<File> f(new File());
  f->data_ = data;
  f->size_ = size;
  f->name_ = name;
  f->parse_all();
  return f;
}

const TensorInfo* File::find_tensor(std::string_view name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

Tensor File::view(std::string_view name) const {
  const TensorInfo* t = find_tensor(name);
  if (t == nullptr) fail(ErrorKind::not_found, "{}: no tensor named '{}'", name_, name);
  return t->view(name_);
}

Tensor File::weight_view(std::string_view name) const {
  const TensorInfo* t = find_tensor(name);
  if (t == nullptr) fail(ErrorKind::not_found, "{}: no tensor named '{}'", name_, name);
  return t->weight_view(name_);
}

void File::parse_all() {
  const std::string& file = name_;
  if (size_ < 8)
    fail(ErrorKind::invalid_input, "{}: file is {} bytes, too short for a safetensors header length", file,
         size_);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | data_[i];  // little-endian, independent of host order
  if (n > kMaxHeaderBytes)
    fail(ErrorKind::invalid_input, "{}: header length {} exceeds the limit of {} bytes", file, n,
         kMaxHeaderBytes);
  if (n > size_ - 8)
    fail(ErrorKind::invalid_input, "{}: header length {} runs past the end of the file ({} bytes)", file, n,
         size_);
  if (n < 2 || data_[8] != '{')
    fail(ErrorKind::invalid_input, "{}: header does not start with a JSON object", file);
  header_bytes_ = static_cast<size_t>(n);
  const uint8_t* base = data_ + 8 + header_bytes_;
  const uint64_t data_size = size_ - 8 - header_bytes_;

  const json header = parse_header_json(data_ + 8, header_bytes_, file);
  if (!header.is_object())
    fail(ErrorKind::invalid_input, "{}: header must be a JSON object, found {}", file, header.type_name());

  for (const auto& [key, entry] : header.items()) {
    if (key == "__metadata__") {
      if (entry.is_null()) continue;
      if (!entry.is_object())
        fail(ErrorKind::invalid_input, "{}: __metadata__ must be an object of strings, found {}", file,
             entry.type_name());
      for (const auto& [mk, mv] : entry.items()) {
        if (!mv.is_string())
          fail(ErrorKind::invalid_input, "{}: __metadata__ key '{}' must be a string, found {}", file, mk,
               mv.type_name());
        metadata_.emplace(mk, mv.get<std::string>());
      }
      continue;
    }
    if (!entry.is_object())
      fail(ErrorKind::invalid_input, "{}: tensor '{}': entry must be an object, found {}", file, key,
           entry.type_name());
    TensorInfo t;
    t.name = key;

    const auto dt_it = entry.find("dtype");
    if (dt_it == entry.end() || !dt_it->is_string())
      fail(ErrorKind::invalid_input, "{}: tensor '{}': missing or non-string 'dtype'", file, key);
    const auto& dt_name = dt_it->get_ref<const std::string&>();
    const auto dt = st_dtype_from_name(dt_name);
    if (!dt) fail(ErrorKind::unsupported, "{}: tensor '{}': unknown dtype '{}'", file, key, dt_name);
    t.st_dtype = *dt;

    const auto sh_it = entry.find("shape");
    if (sh_it == entry.end() || !sh_it->is_array())
      fail(ErrorKind::invalid_input, "{}: tensor '{}': missing or non-array 'shape'", file, key);
    if (sh_it->size() > static_cast<size_t>(Tensor::kMaxDims))
      fail(ErrorKind::unsupported, "{}: tensor '{}': {} dimensions (at most {} supported)", file, key,
           sh_it->size(), Tensor::kMaxDims);
    t.ndim = static_cast<int>(sh_it->size());
    // numel * element size must fit in uint64 (and in the file, checked below).
    uint64_t bytes = st_dtype_size(t.st_dtype);
    for (int i = 0; i < t.ndim; ++i) {
      const uint64_t d = json_index((*sh_it)[static_cast<size_t>(i)], file, key, "shape");
      t.shape[static_cast<size_t>(i)] = static_cast<int64_t>(d);
      if (__builtin_mul_overflow(bytes, d, &bytes))
        fail(ErrorKind::invalid_input, "{}: tensor '{}': shape {} overflows the byte count", file, key,
             sh_it->dump());
    }

    const auto off_it = entry.find("data_offsets");
    if (off_it == entry.end() || !off_it->is_array() || off_it->size() != 2)
      fail(ErrorKind::invalid_input, "{}: tensor '{}': 'data_offsets' must be an array [begin, end]", file,
           key);
    t.begin = json_index((*off_it)[0], file, key, "data_offsets");
    t.end = json_index((*off_it)[1], file, key, "data_offsets");
    if (t.end < t.begin)
      fail(ErrorKind::invalid_input, "{}: tensor '{}': data_offsets [{}, {}] end before begin", file, key,
           t.begin, t.end);
    if (t.end > data_size)
      fail(ErrorKind::invalid_input,
           "{}: tensor '{}': data_offsets [{}, {}] run past the data section ({} bytes; file truncated?)", file,
           key, t.begin, t.end, data_size);
    if (t.end - t.begin != bytes)
      fail(ErrorKind::invalid_input,
           "{}: tensor '{}': {} {} needs {} bytes but data_offsets [{}, {}] span {}", file, key,
           st_dtype_name(t.st_dtype), t.shape_string(), bytes, t.begin, t.end, t.end - t.begin);
    t.data = base + t.begin;
    t.aligned = reinterpret_cast<uintptr_t>(t.data) % st_dtype_size(t.st_dtype) == 0;
    if (!t.aligned) ++misaligned_;
    tensors_.push_back(std::move(t));
  }

  // Byte ranges must not share bytes; empty tensors take none and never clash.
  std::sort(tensors_.begin(), tensors_.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  const TensorInfo* prev = nullptr;
  for (const auto& t : tensors_) {
    if (t.begin == t.end) continue;
    if (prev != nullptr && t.begin < prev->end)
      fail(ErrorKind::invalid_input, "{}: tensors '{}' [{}, {}] and '{}' [{}, {}] overlap", file, prev->name,
           prev->begin, prev->end, t.name, t.begin, t.end);
    prev = &t;
  }
  for (size_t i = 0; i < tensors_.size(); ++i) index_.emplace(tensors_[i].name, i);
}

}  // namespace loom::safetensors
