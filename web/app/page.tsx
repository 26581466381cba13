import { ChatApp } from "@/components/ChatApp";

// One page: the open chat is `?s=<session id>`, so the static export needs no dynamic routes.
export default function Page() {
  return <ChatApp />;
}
