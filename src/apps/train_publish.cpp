// Publishing a trained adapter to a running server (train_publish.h).
#include "apps/train_publish.h"

#include <httplib.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "apps/cli_common.h"
#include "core/error.h"

namespace loom::app {
namespace {

// The server's reply as one line: an OpenAI error object's message, else the body (cut short).
std::string reply_text(const std::string& body) {
  const nlohmann::json j = nlohmann::json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_object() && j.contains("error") && j["error"].is_object() && j["error"].contains("message") &&
      j["error"]["message"].is_string())
    return j["error"]["message"].get<std::string>();
  if (j.is_object() && j.contains("message") && j["message"].is_string())
    return j["message"].get<std::string>();
  std::string s = body.substr(0, 500);
  std::replace(s.begin(), s.end(), '\n', ' ');
  while (!s.empty() && s.back() == ' ') s.pop_back();
  return s.empty() ? "(empty body)" : s;
}

// Why a request got no answer, in words an operator acts on.
std::string no_answer(httplib::Error e, std::chrono::seconds connect, std::chrono::seconds read) {
  switch (e) {
    case httplib::Error::Connection:
      return "could not connect (connection refused, or no such host): is the server running at this "
             "address?";
    case httplib::Error::ConnectionTimeout:
      return fmt::format("no connection within {} s", connect.count());
    case httplib::Error::Read:
      return fmt::format("no answer within {} s, or the connection closed before one", read.count());
    case httplib::Error::Write:
      return "the connection closed while the request was sent";
    case httplib::Error::SSLConnection:
    case httplib::Error::SSLLoadingCerts:
    case httplib::Error::SSLServerVerification:
      return "TLS failed (" + httplib::to_string(e) + "): check the certificate, or use http://";
    default:
      return httplib::to_string(e);
  }
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

}  // namespace

AdapterPublisher::AdapterPublisher(PublishOptions options, const std::string& output_dir)
    : opt_(std::move(options)) {
  const std::string& url = opt_.url;
  const auto bad = [&](const std::string& why) {
    fail(ErrorKind::invalid_input, "--publish '{}': {}", url, why);
  };
  const size_t sep = url.find("://");
  const std::string scheme = sep == std::string::npos ? "" : lower(url.substr(0, sep));
  if (scheme != "http" && scheme != "https")
    bad("give the server's base URL, http://HOST:PORT or https://HOST:PORT (e.g. http://127.0.0.1:8080)");
  const std::string rest = url.substr(sep + 3);
  if (rest.find_first_of("?#") != std::string::npos)
    bad("a query or fragment has no place in the server's URL");
  const size_t slash = rest.find('/');
  const std::string authority = rest.substr(0, slash);
  std::string path = slash == std::string::npos ? "" : rest.substr(slash);
  if (authority.find('@') != std::string::npos)
    bad("credentials in the URL are not sent: use --api-key-file");
  std::string host = authority, port;
  if (authority.starts_with('[')) {  // IPv6 literal
    const size_t close = authority.find(']');
    if (close == std::string::npos) bad("unclosed '[' in the host");
    host = authority.substr(0, close + 1);
    if (close + 1 < authority.size()) {
      if (authority[close + 1] != ':') bad("expected ':PORT' after the IPv6 address");
      port = authority.substr(close + 2);
    }
  } else if (const size_t colon = authority.rfind(':'); colon != std::string::npos) {
    host = authority.substr(0, colon);
    port = authority.substr(colon + 1);
  }
  if (host.empty() || host == "[]") bad("no host");
  if (authority.find(':') != std::string::npos && !authority.starts_with('[') && port.empty())
    bad("empty port");
  if (!port.empty()) {
    const bool digits = port.size() <= 5 && std::all_of(port.begin(), port.end(), [](char c) {
                          return std::isdigit(static_cast<unsigned char>(c)) != 0;
                        });
    if (!digits || std::stoi(port) < 1 || std::stoi(port) > 65535)
      bad("the port '" + port + "' is not in 1..65535");
  }
  while (path.ends_with('/')) path.pop_back();
  if (path.ends_with("/v1")) path.resize(path.size() - 3);
  while (path.ends_with('/')) path.pop_back();
  origin_ = scheme + "://" + authority;
  prefix_ = path;
  endpoint_ = origin_ + prefix_ + "/v1/load_lora_adapter";
  if (!opt_.api_key_file.empty()) api_key_ = read_api_key_file(opt_.api_key_file, "--api-key-file");
  name_ = opt_.name;
  if (name_.empty()) {
    std::filesystem::path out = std::filesystem::absolute(output_dir).lexically_normal();
    if (!out.has_filename()) out = out.parent_path();
    name_ = out.filename().string();
  }
  if (name_.empty()) fail(ErrorKind::invalid_input, "--publish-name: the adapter's name may not be empty");
}

std::optional<std::string> AdapterPublisher::probe() const {
  httplib::Client cli(origin_);
  cli.set_connection_timeout(opt_.connect_timeout);
  cli.set_read_timeout(std::chrono::seconds(10));
  httplib::Headers headers;
  if (!api_key_.empty()) headers.emplace("Authorization", "Bearer " + api_key_);
  const std::string url = origin_ + prefix_ + "/v1/models";
  const httplib::Result res = cli.Get(prefix_ + "/v1/models", headers);
  if (!res)
    return fmt::format(
        "--publish: the server at {} cannot be reached now ({}); training goes on and the adapter is "
        "published when it is written",
        url, no_answer(res.error(), opt_.connect_timeout, std::chrono::seconds(10)));
  if (res->status == 401 || res->status == 403)
    fail(ErrorKind::invalid_input, "--publish: {} answers {} ({}): {}", url, res->status,
         reply_text(res->body),
         api_key_.empty() ? "the server wants an API key: give it with --api-key-file"
                          : "the key of --api-key-file " + opt_.api_key_file + " is not the server's");
  if (res->status == 404)
    fail(ErrorKind::invalid_input,
         "--publish: {} answers 404: is {} the base URL of a loom serve or vLLM server?", url, opt_.url);
  if (res->status != 200)
    return fmt::format("--publish: {} answers {} ({}) now; training goes on", url, res->status,
                       reply_text(res->body));
  return std::nullopt;
}

PublishOutcome AdapterPublisher::publish(const std::string& path) const {
  httplib::Client cli(origin_);
  cli.set_connection_timeout(opt_.connect_timeout);
  cli.set_read_timeout(opt_.read_timeout);
  cli.set_write_timeout(std::chrono::seconds(10));
  httplib::Headers headers;
  if (!api_key_.empty()) headers.emplace("Authorization", "Bearer " + api_key_);
  const nlohmann::json body = {{"lora_name", name_}, {"lora_path", path}, {"load_inplace", true}};
  const httplib::Result res =
      cli.Post(prefix_ + "/v1/load_lora_adapter", headers, body.dump(), "application/json");
  PublishOutcome out;
  if (!res) {
    out.message = "no answer: " + no_answer(res.error(), opt_.connect_timeout, opt_.read_timeout);
    return out;
  }
  out.status = res->status;
  out.ok = res->status == 200;
  out.message = reply_text(res->body);
  return out;
}

}  // namespace loom::app
